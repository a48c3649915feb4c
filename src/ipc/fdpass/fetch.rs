//! The importer's side: [`fetch`] and [`fetch_many`], which choose a transport, and the socket
//! transport itself, one request over one connection.
//!
//! Owns: [`FdTransport`], the overall deadline of a fetch, and the order of the steps of a socket
//! fetch, each a method of [`Exchange`] (`fetch/exchange.rs`): connect without waiting to a listener that is plainly the exporter
//! ([`Exchange::connect_at_once`]), or else one by one: look at the socket file ([`Exchange::check_socket_file`]), connect
//! ([`Exchange::connect`]), check who listens ([`Exchange::check_listener`]), send the request
//! ([`Exchange::send_request`]), then receive the statuses and fds ([`Exchange::receive_fds`]:
//! one message at a time by [`Exchange::receive_message`], each validated by
//! [`Exchange::check_reply`]). The `pidfd_getfd` transport is `pidfd.rs`'s, the byte layout
//! `wire.rs`'s, the socket path and peer credentials `socket.rs`'s.
//!
//! Who closes what: the connection is owned by [`Exchange::connect`]'s caller and closed when the
//! fetch returns, on success and on failure. The fds of a reply are taken into `OwnedFd`s as soon
//! as `recvmsg` returns, before anything is checked, so every exit closes them; they pass to the
//! caller only when every id is answered, and on an error all of them (also those of earlier
//! replies) are closed here: no fd is left open.

use super::error::FdPassError;
use super::exporter_gone;
use super::pidfd::{PidfdFailure, fetch_pidfd};
use super::wire::MAX_IDS_PER_REQUEST;
use crate::error::{Error, Result};
use crate::identity::ProcessIdentity;
use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

/// How an importer gets an fd from another process.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FdTransport {
    /// Over the exporter's Unix socket with `SCM_RIGHTS`: needs no special rights, checks the id,
    /// cannot return a withdrawn fd. The default.
    #[default]
    Socket,
    /// `pidfd_getfd` when the kernel and the ptrace rules allow it, else the socket (the reason is
    /// logged at debug level). See the [module docs](super) for the caveat on fd numbers.
    PidfdThenSocket,
    /// `pidfd_getfd` only; [`Error::Unsupported`] (with the reason and the fix) when it is refused.
    PidfdOnly,
}

/// Fetches export `id` (whose fd number in the exporter is `raw_fd`) from `exporter`, waiting at most
/// `timeout` in all.
///
/// The caller owns the returned fd: a reference of its own to the exporter's open file, valid after
/// the exporter withdraws it or exits. `cuMemImportFromShareableHandle` does not take ownership of a
/// POSIX fd handle: drop the fd after the import, whether the import succeeded or not.
///
/// `raw_fd` is used only by the `pidfd_getfd` transports (pass
/// [`FdExport::raw_fd`](super::FdExport::raw_fd)); with [`FdTransport::Socket`] any value works.
///
/// # Errors
/// - [`Error::FdPass`] ([`FdPassError`]): [`FdPassError::PeerGone`] when the exporter is no longer
///   running ([`ProcessIdentity::liveness`] says dead: killed, exited, a zombie, its pid reused),
///   found before connecting or when the connection breaks; [`FdPassError::NotOffered`] when the
///   exporter runs but does not offer `id`: it was withdrawn or never made, or the process serves
///   no fds at all (it exported none: no socket file, or nobody listens on it), and with
///   [`FdTransport::PidfdOnly`] also when `raw_fd` is not open in the exporter;
///   [`FdPassError::Refused`] when the exporter refuses this process (another user, not root);
///   [`FdPassError::VersionMismatch`] when the two processes speak different protocol versions;
///   [`FdPassError::NotTheExporter`] when something other than a socket is at the socket path (a
///   FIFO, a file, a directory, a symbolic link) or the listener fails the peer check (see the
///   [module docs](super): another pid in this pid namespace; across pid namespaces, a file or
///   listener of another user). Each names the reason and the fix.
/// - [`Error::Unsupported`] with [`FdTransport::PidfdOnly`] when `pidfd_getfd` is refused (kernel
///   before 5.6, ptrace rules, seccomp, an exporter in another pid namespace): the reason and the
///   fix are in the error.
/// - [`Error::Timeout`] when the exporter's server does not answer within `timeout`.
/// - [`Error::InvalidArgument`] with [`FdTransport::PidfdOnly`] and a negative `raw_fd`.
/// - [`Error::Os`] for other failed system calls (`lstat`, `socket`, `connect`, `sendmsg`,
///   `recvmsg`, `pidfd_open`, `pidfd_getfd`) and for a malformed reply.
///
/// See `unix(7)` (`SCM_RIGHTS`) and `pidfd_getfd(2)`; example on [`FdExport`](super::FdExport).
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
/// Ownership and errors as [`fetch`]; [`FdPassError::NotOffered`] names the first id not offered.
#[doc(alias = "SCM_RIGHTS")]
#[doc(alias = "pidfd_getfd")]
pub fn fetch_many(
    exporter: &ProcessIdentity,
    ids: &[(u32, i32)],
    transport: FdTransport,
    timeout: Duration,
) -> Result<Vec<OwnedFd>> {
    fetch_many_then(exporter, None, ids, transport, timeout, &mut || {})
}

/// [`fetch_many`] from an exporter known to run as `uid` (for example the owner of a segment it
/// made and this process checked, as a tensor set's manifest). In another pid namespace, where
/// pids cannot be compared, only a socket file and a listener of that uid are taken, also by a
/// root importer (which [`fetch_many`] lets take any one user's listener whose file it owns, as
/// long as the exporter lives), and only a liveness lock file of that uid says the exporter
/// lives. In this pid namespace the listener's pid decides, as with [`fetch_many`].
///
/// # Errors
/// As [`fetch_many`]; [`FdPassError::NotTheExporter`] when, across pid namespaces, the socket
/// file or its listener belongs to another uid than `uid`.
#[doc(alias = "SCM_RIGHTS")]
pub fn fetch_many_from_uid(
    exporter: &ProcessIdentity,
    uid: u32,
    ids: &[(u32, i32)],
    transport: FdTransport,
    timeout: Duration,
) -> Result<Vec<OwnedFd>> {
    fetch_many_then(exporter, Some(uid), ids, transport, timeout, &mut || {})
}

/// The parts of a fetch the calling thread's time is kept for ([`fetch_times_on_this_thread`]).
#[derive(Clone, Copy)]
pub(crate) enum FetchStep {
    /// The exporter's liveness: before connecting (the `pidfd_getfd` transports), or once the
    /// request is sent (a socket listener of another uid).
    Peer,
    /// The socket path's `lstat`, the connection and the listener's checks (`SO_PEERCRED`).
    Connect,
    /// The request sent and the fds received (the exporter's server wakes, checks the client and
    /// answers), less the caller's `waiting` work.
    Reply,
}

/// How many [`FetchStep`]s there are.
pub(crate) const FETCH_STEPS: usize = FetchStep::Reply as usize + 1;

thread_local! {
    /// Time the calling thread spent in each [`FetchStep`].
    static FETCH_TIME_HERE: std::cell::Cell<[Duration; FETCH_STEPS]> =
        const { std::cell::Cell::new([Duration::ZERO; FETCH_STEPS]) };
}

/// Adds the time since `since` to `step`; returns now, for the next lap.
fn lap(step: FetchStep, since: Instant) -> Instant {
    let now = Instant::now();
    add_fetch_time(step, now.saturating_duration_since(since));
    now
}

fn add_fetch_time(step: FetchStep, d: Duration) {
    FETCH_TIME_HERE.with(|c| {
        let mut t = c.get();
        t[step as usize] = t[step as usize].saturating_add(d);
        c.set(t);
    });
}

/// Wall-clock time the calling thread spent so far in each [`FetchStep`], indexed by it: the
/// difference around one call is what its fetches took.
pub(crate) fn fetch_times_on_this_thread() -> [Duration; FETCH_STEPS] {
    FETCH_TIME_HERE.with(std::cell::Cell::get)
}

/// How often a socket fetch waiting for the exporter's reply asks whether the exporter is still
/// alive: a listener that outlived it (inherited by a forked child that never accepts) is
/// answered with [`FdPassError::PeerGone`] within this, not at the fetch's timeout.
const REPLY_LIVENESS_EVERY: Duration = Duration::from_millis(100);

/// How long a socket fetch looks for the exporter's first reply message without sleeping
/// (`recvmsg` with `MSG_DONTWAIT`, over and over) before it blocks in `recvmsg`: an exporter's
/// server answers within about 0.1 ms, and a thread that slept for it waits for its own wake-up
/// too. Bounded, once per fetch: a slow server costs this much CPU time at most.
const REPLY_SPIN: Duration = Duration::from_micros(200);

/// How many connections a socket fetch makes for one request when the exporter's server closes a
/// connection before answering any id. The server gives up on a client whose request has not
/// arrived within its 1 s receive timeout: an importer stalled that long between its `connect`
/// and its `send` (a loaded machine, a page fault waiting for the disk) finds its connection
/// closed unanswered. Asking again over a new connection is safe (a fetch only copies fds); a
/// listener that keeps closing unanswered is an error after this many.
const UNANSWERED_TRIES: usize = 3;

/// [`fetch_many`], running `waiting` once while the exporter prepares its answer (over the
/// socket, after the request went out; its reply waits meanwhile): work of the caller's that then
/// costs no time of its own, such as starting a thread. The `pidfd_getfd` transports, which wait
/// for nobody, run it first. Where the fetch fails before its request is sent (or `ids` is
/// empty) `waiting` is not run: the caller does that work itself.
///
/// The socket transport does not ask the exporter's liveness before connecting (in a fresh
/// process its `/proc` reads cost tens of µs): the socket path is named by the exporter's pid
/// namespace, pid and start time, its listener must have the exporter's pid (in this pid
/// namespace), and a listener of this process's own uid or root's vouches for the rest (a process
/// of this user that bound another process's path on purpose could read this user's segments
/// anyway). A listener of another uid (this process is root) is asked about once the request is
/// sent, before any fd is read. Liveness is also asked when a step fails (a refusal by whatever
/// stands at the path is then [`FdPassError::PeerGone`]), and every [`REPLY_LIVENESS_EVERY`]
/// while the connection, the send or the reply waits (a listener kept by a forked child of a
/// dead exporter never answers). `pidfd_getfd` takes an fd from whatever process has the pid
/// now: its transports ask first.
///
/// # Errors
/// As [`fetch_many`].
pub(crate) fn fetch_many_then(
    exporter: &ProcessIdentity,
    owner: Option<u32>,
    ids: &[(u32, i32)],
    transport: FdTransport,
    timeout: Duration,
    waiting: &mut dyn FnMut(),
) -> Result<Vec<OwnedFd>> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let deadline = Deadline::new(timeout);
    let peer_gone = || {
        let t = Instant::now();
        let r = alive(exporter, owner);
        lap(FetchStep::Peer, t);
        r
    };
    match transport {
        FdTransport::Socket => fetch_socket(exporter, owner, ids, &deadline, waiting),
        FdTransport::PidfdOnly => {
            // Nothing to wait for here: the caller's work runs first.
            waiting();
            peer_gone()?;
            fetch_pidfd(exporter, ids).map_err(|f| f.into_error(exporter))
        }
        FdTransport::PidfdThenSocket => {
            waiting();
            peer_gone()?;
            match fetch_pidfd(exporter, ids) {
                Ok(fds) => Ok(fds),
                Err(PidfdFailure::Gone) => {
                    Err(Error::FdPass(FdPassError::PeerGone { pid: exporter.pid }))
                }
                Err(PidfdFailure::Other(e)) => Err(e),
                Err(f) => {
                    tracing::debug!(
                        pid = exporter.pid,
                        "pidfd_getfd not used, falling back to the socket: {}",
                        f.describe()
                    );
                    fetch_socket(exporter, owner, ids, &deadline, &mut || {})
                }
            }
        }
    }
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
/// `waiting` runs during the first request's wait ([`fetch_many_then`]).
fn fetch_socket(
    exporter: &ProcessIdentity,
    owner: Option<u32>,
    ids: &[(u32, i32)],
    deadline: &Deadline,
    waiting: &mut dyn FnMut(),
) -> Result<Vec<OwnedFd>> {
    let mut out = Vec::with_capacity(ids.len());
    let mut waiting = Some(waiting);
    for chunk in ids.chunks(MAX_IDS_PER_REQUEST) {
        let only_ids: Vec<u32> = chunk.iter().map(|(id, _)| *id).collect();
        let mut tries = 0;
        let fds = loop {
            tries += 1;
            match fetch_socket_once(exporter, owner, &only_ids, deadline, waiting.take())? {
                Answer::Fds(fds) => break fds,
                Answer::ClosedUnanswered(e) if tries >= UNANSWERED_TRIES => {
                    return Err(gone_or(exporter, owner, e));
                }
                Answer::ClosedUnanswered(e) => {
                    // The exporter's server gave up on this connection (see
                    // `UNANSWERED_TRIES`): ask again over a new one, unless it is gone or time
                    // is up.
                    alive(exporter, owner)?;
                    deadline.remaining(WAIT_WHAT)?;
                    tracing::debug!(
                        pid = exporter.pid,
                        tries,
                        "fd server closed the connection unanswered, asking again: {e}"
                    );
                }
            }
        };
        out.extend(fds);
    }
    Ok(out)
}

/// What one request over one connection came to, where it did not fail.
enum Answer {
    /// The fds of every id asked for, in order.
    Fds(Vec<OwnedFd>),
    /// The server closed the connection before answering any id (the error that says so, for
    /// when no try is left).
    ClosedUnanswered(Error),
}

/// [`FdPassError::PeerGone`] when the exporter is gone ([`exporter_gone`]; with its uid known,
/// `owner`, a liveness lock file counts only if that uid owns it).
fn alive(exporter: &ProcessIdentity, owner: Option<u32>) -> Result<()> {
    if exporter_gone(exporter, owner) {
        Err(Error::FdPass(FdPassError::PeerGone { pid: exporter.pid }))
    } else {
        Ok(())
    }
}

/// Error for a connection that broke: the exporter is gone, or `otherwise`.
fn gone_or(exporter: &ProcessIdentity, owner: Option<u32>, otherwise: Error) -> Error {
    alive(exporter, owner).err().unwrap_or(otherwise)
}

/// What a socket fetch waits for, as its [`Error::Timeout`] names it.
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
    Error::FdPass(FdPassError::NotTheExporter {
        reason: format!(
            "the fd socket {path} of {exporter} (another pid namespace, where pids cannot be \
             compared) is owned by uid {owner}{listener}; this process (uid {euid}) accepts it only \
             when file and listener belong to one uid, its own or root's (root accepts any one uid)"
        ),
        fix: "run the exporter and the importer as the same user; if they do, another user's \
              process squats on the exporter's socket path",
    })
}

/// The refusal of a socket of an exporter in another pid namespace known to run as `uid` whose
/// `what` (the file, the listener) belongs to `found`.
fn not_the_owner(
    exporter: &ProcessIdentity,
    path: &str,
    uid: u32,
    found: u32,
    what: &str,
) -> Error {
    Error::FdPass(FdPassError::NotTheExporter {
        reason: format!(
            "the fd socket {path} of {exporter} (another pid namespace, where pids cannot be \
             compared) is served as uid {found} ({what}), and the exporter runs as uid {uid}"
        ),
        fix: "another user's process squats on the exporter's socket path; find it with \
              `ss -xlp`",
    })
}

/// One request over one connection: the steps below, in order. All or nothing: the fds of every id,
/// in the order of `ids`, or an error (or [`Answer::ClosedUnanswered`]) and no fd left open.
/// `waiting` (if any) runs once the request is sent, before the reply is read.
fn fetch_socket_once(
    exporter: &ProcessIdentity,
    owner: Option<u32>,
    ids: &[u32],
    deadline: &Deadline,
    waiting: Option<&mut dyn FnMut()>,
) -> Result<Answer> {
    let t = Instant::now();
    let x = Exchange::new(exporter, owner, ids);
    // What stands at the path, or who listens there, says nothing once the exporter is gone:
    // such a refusal is `PeerGone` then (as a failed connection is), so that a caller falls back
    // to another source of the fds.
    let connected = match x.connect_at_once() {
        Some(Ok(known)) => Ok(known),
        // Connected, but not to a listener with the exporter's pid and this process's uid: the
        // file and the listener are judged by the rules.
        Some(Err(sock)) => x
            .check_socket_file()
            .and_then(|file| Ok((x.check_listener(&sock, &file)?, sock)))
            .map(|(server, sock)| (sock, server)),
        None => x.check_socket_file().and_then(|file| {
            let sock = x.connect(&file, deadline)?;
            let server = x.check_listener(&sock, &file)?;
            Ok((sock, server))
        }),
    };
    let (sock, server) = connected.map_err(|e| match e {
        Error::FdPass(FdPassError::PeerGone { .. }) => e,
        e => x.gone_or(e),
    })?;
    let t = lap(FetchStep::Connect, t);
    x.send_request(&sock, ids, deadline)?;
    // The caller's work, while the exporter's server wakes and answers; not counted as the
    // reply's time.
    let w = Instant::now();
    if let Some(waiting) = waiting {
        waiting();
    }
    let w = w.elapsed();
    if !x.vouched_by_uid(&server) {
        // A listener of another user's (this process is root, or the exporter was): only the
        // exporter's liveness, asked now that the connection is made, says its pid is still the
        // exporter's. Asked while the server answers, before any fd is read.
        let p = Instant::now();
        let r = alive(exporter, owner);
        add_fetch_time(FetchStep::Peer, p.elapsed());
        r?;
    }
    let fds = x.receive_fds(&sock, ids, server, deadline);
    add_fetch_time(FetchStep::Reply, t.elapsed().saturating_sub(w));
    fds
}

mod exchange;
use exchange::Exchange;

#[cfg(test)]
mod tests;
