//! The steps of one socket fetch, each a method of [`Exchange`] (what every step needs: whom it
//! asks, at which path, as which uid): connect at once to a listener that is plainly the
//! exporter, or else look at the socket file, connect and check who listens; send the request;
//! receive the statuses and fds one message at a time, each validated. `fetch.rs` runs them in
//! order (`fetch_socket_once`) and owns the deadline, the retries and the errors they share.

use super::super::error::FdPassError;
use super::super::socket::{PeerCred, describe_path, peer_cred, socket_path};
use super::super::wire::{
    ENTRY_OK, MAX_FDS_PER_MESSAGE, MAX_REPLY_BYTES, PROTOCOL_VERSION, REQUEST_OK, REQUEST_REFUSED,
    REQUEST_VERSION, decode_reply, encode_request,
};
use super::{
    Answer, Deadline, REPLY_LIVENESS_EVERY, REPLY_SPIN, WAIT_WHAT, alive, cross_namespace_refusal,
    gone_or, not_the_owner,
};
use crate::error::{Error, OsError, Result};
use crate::identity::ProcessIdentity;
use rustix::io::Errno;
use rustix::net::sockopt::{self, Timeout};
use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendFlags,
    SocketAddrUnix, SocketFlags, SocketType,
};
use std::io::IoSliceMut;
use std::mem::MaybeUninit;
use std::os::fd::OwnedFd;
use std::time::Instant;

/// What every step of one socket fetch needs: whom it asks, at which path, as which uid.
pub(super) struct Exchange<'a> {
    exporter: &'a ProcessIdentity,
    /// The exporter's socket path ([`socket_path`]).
    path: String,
    /// This process's effective uid.
    euid: u32,
    /// The uid the exporter runs as, where the caller knows it ([`fetch_many_from_uid`](super::fetch_many_from_uid)).
    owner: Option<u32>,
    /// The first id asked for: the one named when the process serves no fds at all.
    first_id: u32,
}

/// What [`Exchange::check_socket_file`] found at the socket path: a socket, with these facts.
pub(super) struct SocketFile {
    /// The file's owner uid.
    owner: u32,
    /// The file's mode (`st_mode`), for the error when connecting is refused.
    mode: u32,
    /// Whether the exporter runs in this process's pid namespace (then its pid is compared with
    /// the listener's; otherwise uids and the file's owner are).
    same_ns: bool,
}

/// What one [`Exchange::receive_message`] came to.
enum Message {
    /// A message, its fds already owned.
    Got(Received),
    /// Nothing yet: call again.
    Again,
    /// The server closed the connection (end of file); the error that says so.
    Closed(Error),
}

/// One message [`Exchange::receive_message`] received, its fds already owned.
struct Received {
    /// Bytes received; the message is the first this many bytes of the buffer.
    bytes: usize,
    /// The kernel's flags on the message (`MSG_TRUNC`, `MSG_CTRUNC`).
    flags: ReturnFlags,
    /// The fds attached (`SCM_RIGHTS`), closed when dropped.
    fds: Vec<OwnedFd>,
}

impl<'a> Exchange<'a> {
    pub(super) fn new(exporter: &'a ProcessIdentity, owner: Option<u32>, ids: &[u32]) -> Self {
        Exchange {
            exporter,
            path: socket_path(exporter),
            euid: rustix::process::geteuid().as_raw(),
            owner,
            first_id: ids.first().copied().unwrap_or(0),
        }
    }

    /// A failed system call on the socket path.
    fn os(&self, call: &'static str, e: Errno) -> Error {
        Error::from(OsError::new(call, self.path.clone(), e))
    }

    /// The error for an exporter that serves no fds: no socket file, or nobody listens on it.
    fn not_offered(&self) -> Error {
        Error::FdPass(FdPassError::NotOffered {
            pid: self.exporter.pid,
            id: self.first_id,
            reason: "the process serves no fds (it has exported none)",
        })
    }

    /// [`FdPassError::PeerGone`] when the exporter is gone, or `otherwise`.
    pub(super) fn gone_or(&self, otherwise: Error) -> Error {
        gone_or(self.exporter, self.owner, otherwise)
    }

    /// [`alive`] for this exchange's exporter.
    fn alive(&self) -> Result<()> {
        alive(self.exporter, self.owner)
    }

    /// An fd-server reply that does not follow the protocol.
    fn malformed(&self, why: String) -> Error {
        OsError::io(
            "recvmsg",
            self.path.clone(),
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("malformed fd-server reply: {why}"),
            ),
        )
        .into()
    }

    /// Step 1: what is at the path, not following a symbolic link. Only a socket is connected to,
    /// so a FIFO, a file, a directory or a link planted there is refused at once, never waited on;
    /// across pid namespaces, a socket file of another user (neither this process's nor root's) is
    /// refused before connecting.
    pub(super) fn check_socket_file(&self) -> Result<SocketFile> {
        let (exporter, path, euid) = (self.exporter, &self.path, self.euid);
        let st = match rustix::fs::lstat(path.as_str()) {
            Ok(st) => st,
            Err(Errno::NOENT) => return Err(self.gone_or(self.not_offered())),
            Err(e) => return Err(self.gone_or(self.os("lstat", e))),
        };
        if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::Socket {
            return Err(Error::FdPass(FdPassError::NotTheExporter {
                reason: format!(
                    "{path} (the fd socket of {exporter}) is {}, not a socket",
                    describe_path(path)
                ),
                fix: "something other than the exporter's fd server was put at its socket path; \
                      remove it (only the exporter makes that file)",
            }));
        }
        let owner = st.st_uid;
        let same_ns = exporter.in_own_pid_namespace();
        // Root accepts any user's socket whose file and listener agree: it is served by every
        // exporter, and while an exporter runs, its socket path cannot be taken from it (a squatter
        // bound first makes the exporter's own `FdExport::new` fail, and the sticky /dev/shm keeps
        // others from replacing its file).
        if !same_ns && owner != euid && owner != 0 && euid != 0 {
            // Across pid namespaces the owner is what tells the exporter's socket from another's.
            return Err(cross_namespace_refusal(exporter, path, owner, None, euid));
        }
        if let Some(uid) = self.owner
            && !same_ns
            && owner != uid
        {
            return Err(not_the_owner(exporter, path, uid, owner, "its socket file"));
        }
        Ok(SocketFile {
            owner,
            mode: st.st_mode,
            same_ns,
        })
    }

    /// Steps 1 to 3 at once, where the path holds what it should: a connection without waiting
    /// (`SOCK_NONBLOCK` for the `connect`, blocking again after it) to a listener whose
    /// `SO_PEERCRED` has the exporter's pid and this process's effective uid (the exporter's,
    /// where the caller knows it), at a path that is itself a socket of that uid (`lstat` after
    /// the connection: `connect` follows a symbolic link, which the rules refuse). The rules of [`Exchange::check_listener`] accept that listener
    /// whichever pid namespace the exporter runs in (its own pid, or a uid that is this
    /// process's and the socket file's), so the look at this process's pid namespace (a `/proc`
    /// lookup, tens of µs in a fresh process) is not made for it. `Some(Ok(..))`: that connection and its listener; `Some(Err(sock))`:
    /// connected to another listener, which the caller judges by the rules; `None`: not
    /// connected (nothing there, a FIFO, a file, a link to nothing, a full backlog, a refusal:
    /// the steps one by one then say what stands there, as before).
    pub(super) fn connect_at_once(
        &self,
    ) -> Option<std::result::Result<(OwnedFd, PeerCred), OwnedFd>> {
        let sock = rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
            None,
        )
        .ok()?;
        let addr = SocketAddrUnix::new(self.path.as_str()).ok()?;
        rustix::net::connect(&sock, &addr).ok()?;
        rustix::io::ioctl_fionbio(&sock, false).ok()?;
        let Ok(server) = peer_cred(&sock) else {
            return Some(Err(sock));
        };
        let uid_known = self.owner.is_none_or(|uid| uid == self.euid);
        // `connect` follows a symbolic link: the path itself must be a socket of the listener's
        // uid (one `lstat`, no `/proc` lookup), or the rules judge it (they refuse a link).
        let bound_here = rustix::fs::lstat(self.path.as_str()).is_ok_and(|st| {
            rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::Socket
                && st.st_uid == server.uid
        });
        if server.pid == self.exporter.pid && server.uid == self.euid && uid_known && bound_here {
            Some(Ok((sock, server)))
        } else {
            Some(Err(sock))
        }
    }

    /// Step 2: a new `SOCK_SEQPACKET` socket connected to the path, within the deadline (a
    /// Unix-socket connect waits for room in the listener's backlog up to `SO_SNDTIMEO`). The
    /// returned socket is the caller's; on an error it is closed here.
    pub(super) fn connect(&self, file: &SocketFile, deadline: &Deadline) -> Result<OwnedFd> {
        let (exporter, path, euid) = (self.exporter, &self.path, self.euid);
        let sock = rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .map_err(|e| self.os("socket", e))?;
        let addr = SocketAddrUnix::new(path.as_str()).map_err(|e| self.os("connect", e))?;
        loop {
            // A full backlog (a listener nobody accepts on) is waited for in slices, each
            // ending with a look at the exporter's liveness (below).
            let slice = deadline.remaining(WAIT_WHAT)?.min(REPLY_LIVENESS_EVERY);
            sockopt::set_socket_timeout(&sock, Timeout::Send, Some(slice))
                .map_err(|e| self.os("setsockopt", e))?;
            match rustix::net::connect(&sock, &addr) {
                Ok(()) => return Ok(sock),
                Err(Errno::INTR) => continue,
                Err(Errno::CONNREFUSED | Errno::NOENT) => {
                    return Err(self.gone_or(self.not_offered()));
                }
                Err(Errno::ACCESS | Errno::PERM) => {
                    return Err(Error::FdPass(FdPassError::Refused {
                        reason: format!(
                            "the fd socket {path} of {exporter} is owned by uid {} with mode \
                             {:o}: it serves fds only to its own user and root, and this process \
                             runs as uid {euid}",
                            file.owner,
                            file.mode & 0o7777
                        ),
                    }));
                }
                Err(Errno::AGAIN) => {
                    self.alive()?;
                    deadline.remaining(WAIT_WHAT)?;
                    continue;
                }
                Err(e) => return Err(self.gone_or(self.os("connect", e))),
            }
        }
    }

    /// Step 3: who listens there? The listener's credentials (`SO_PEERCRED`, taken when it called
    /// `listen`) must be the exporter's: in this pid namespace its pid; across pid namespaces a uid
    /// that is this process's or root's (any one uid, for root) and that owns the socket file,
    /// and the exporter's own uid where the caller knows it ([`fetch_many_from_uid`](super::fetch_many_from_uid)).
    /// Returns them, for the refusal message of a later step.
    pub(super) fn check_listener(&self, sock: &OwnedFd, file: &SocketFile) -> Result<PeerCred> {
        let (exporter, path, euid) = (self.exporter, &self.path, self.euid);
        let server = peer_cred(sock).map_err(|e| self.os("getsockopt(SO_PEERCRED)", e))?;
        if file.same_ns {
            if server.pid != exporter.pid {
                return Err(Error::FdPass(FdPassError::NotTheExporter {
                    reason: format!(
                        "the socket {path} of pid {} is held by pid {}",
                        exporter.pid, server.pid
                    ),
                    fix: "another process squats on the exporter's socket path; find it with \
                          `ss -xlp`",
                }));
            }
        } else if !(server.uid == euid || server.uid == 0 || euid == 0) || server.uid != file.owner
        {
            return Err(cross_namespace_refusal(
                exporter,
                path,
                file.owner,
                Some(server.uid),
                euid,
            ));
        } else if let Some(uid) = self.owner
            && server.uid != uid
        {
            return Err(not_the_owner(
                exporter,
                path,
                uid,
                server.uid,
                "its listener",
            ));
        }
        Ok(server)
    }

    /// Whether the listener's uid vouches for it being the exporter, with its pid checked
    /// ([`Exchange::check_listener`]): this process's own uid (the socket path holds the
    /// exporter's pid namespace, pid and start time, which no other process of this user binds
    /// by mistake, and one that would could read this user's segments anyway) or root's. A
    /// listener of another uid (this process is root) is the exporter only while the exporter
    /// lives: its liveness is asked before the fds are read (in this pid namespace by `/proc`;
    /// across pid namespaces by a liveness lock, which any user can hold: see the module docs).
    pub(super) fn vouched_by_uid(&self, server: &PeerCred) -> bool {
        server.uid == self.euid || server.uid == 0
    }

    /// Step 4: sends the request for `ids` (one message), within the deadline. A server that
    /// refuses this process answers without reading and closes: a send that finds the connection
    /// reset counts as sent, and the refusal is read in the next step.
    pub(super) fn send_request(
        &self,
        sock: &OwnedFd,
        ids: &[u32],
        deadline: &Deadline,
    ) -> Result<()> {
        let request = encode_request(ids);
        loop {
            let slice = deadline.remaining(WAIT_WHAT)?.min(REPLY_LIVENESS_EVERY);
            sockopt::set_socket_timeout(sock, Timeout::Send, Some(slice))
                .map_err(|e| self.os("setsockopt", e))?;
            match rustix::net::send(sock, &request, SendFlags::NOSIGNAL) {
                Ok(n) if n == request.len() => return Ok(()),
                Ok(_) => return Err(self.os("send", Errno::MSGSIZE)),
                Err(Errno::INTR) => continue,
                Err(Errno::AGAIN) => {
                    self.alive()?;
                    deadline.remaining(WAIT_WHAT)?;
                    continue;
                }
                // The server answered without reading (a refusal) and closed: its reply is queued.
                Err(Errno::PIPE | Errno::CONNRESET) => return Ok(()),
                Err(e) => return Err(self.gone_or(self.os("send", e))),
            }
        }
    }

    /// Step 5: receives reply messages until every id is answered, each checked by
    /// [`Exchange::check_reply`]; returns the fds in the order of `ids`. On an error every fd
    /// received so far is closed (dropped) here.
    pub(super) fn receive_fds(
        &self,
        sock: &OwnedFd,
        ids: &[u32],
        server: PeerCred,
        deadline: &Deadline,
    ) -> Result<Answer> {
        let mut out: Vec<OwnedFd> = Vec::with_capacity(ids.len());
        let mut buf = vec![0u8; MAX_REPLY_BYTES + 1];
        let mut space =
            vec![MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS_PER_MESSAGE))];
        let mut answered = 0usize;
        let mut reset_seen = false;
        // The first message is looked for without sleeping until `REPLY_SPIN` has passed (or
        // the deadline, if sooner).
        let spin_until = Instant::now() + REPLY_SPIN;
        let spin_until = deadline.at.map_or(spin_until, |at| at.min(spin_until));
        while answered < ids.len() {
            let spin = answered == 0 && Instant::now() < spin_until;
            let mut got = match self.receive_message(
                sock,
                &mut buf,
                &mut space,
                &mut reset_seen,
                deadline,
                spin,
            )? {
                Message::Got(got) => got,
                Message::Again => continue,
                Message::Closed(e) if answered == 0 => return Ok(Answer::ClosedUnanswered(e)),
                Message::Closed(e) => return Err(self.gone_or(e)),
            };
            let message = buf.get(..got.bytes).unwrap_or(&[]);
            let n =
                self.check_reply(message, got.flags, got.fds.len(), &ids[answered..], server)?;
            answered += n;
            out.append(&mut got.fds);
        }
        Ok(Answer::Fds(out))
    }

    /// One `recvmsg` into `buf` and `space`, within the deadline. The fds that arrived are taken
    /// into `OwnedFd`s before anything else, so every exit closes them. [`Message::Again`]:
    /// nothing yet, call again (interrupted, `SO_RCVTIMEO` ran out with time left, nothing there
    /// yet where `spin` asked not to sleep (`MSG_DONTWAIT`), or the one reset a refusing server
    /// causes, which `reset_seen` records). [`Message::Closed`]: the server closed the
    /// connection (the caller judges whether before any answer).
    fn receive_message(
        &self,
        sock: &OwnedFd,
        buf: &mut [u8],
        space: &mut [MaybeUninit<u8>],
        reset_seen: &mut bool,
        deadline: &Deadline,
        spin: bool,
    ) -> Result<Message> {
        let mut flags = RecvFlags::CMSG_CLOEXEC;
        if spin {
            // Not sleeping: nothing there yet is `Ok(None)` at once (below).
            flags |= RecvFlags::DONTWAIT;
        } else {
            // Every `REPLY_LIVENESS_EVERY` the exporter's liveness is asked (below): nothing
            // before the exchange asked it.
            let poll = deadline.remaining(WAIT_WHAT)?.min(REPLY_LIVENESS_EVERY);
            sockopt::set_socket_timeout(sock, Timeout::Recv, Some(poll))
                .map_err(|e| self.os("setsockopt", e))?;
        }
        let mut control = RecvAncillaryBuffer::new(space);
        let got = rustix::net::recvmsg(sock, &mut [IoSliceMut::new(buf)], &mut control, flags);
        // Take ownership of whatever fds arrived before anything else, so every exit closes them.
        let mut fds: Vec<OwnedFd> = Vec::new();
        for msg in control.drain() {
            if let RecvAncillaryMessage::ScmRights(rights) = msg {
                fds.extend(rights);
            }
        }
        let msg = match got {
            Ok(m) => m,
            Err(Errno::INTR) => return Ok(Message::Again),
            Err(Errno::AGAIN) if spin => {
                std::hint::spin_loop();
                return Ok(Message::Again);
            }
            Err(Errno::AGAIN) => {
                // SO_RCVTIMEO ran out: the exporter is gone or time is up (unless it was clamped).
                self.alive()?;
                deadline.remaining(WAIT_WHAT)?;
                return Ok(Message::Again);
            }
            // A server that refuses closes without reading our request; the kernel then reports a
            // reset once (and clears it) before the reply it queued.
            Err(Errno::CONNRESET) if !*reset_seen => {
                *reset_seen = true;
                return Ok(Message::Again);
            }
            Err(e) => return Err(self.gone_or(self.os("recvmsg", e))),
        };
        if msg.bytes == 0 {
            return Ok(Message::Closed(
                OsError::io(
                    "recvmsg",
                    self.path.clone(),
                    std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        "the exporter closed the connection before answering every id",
                    ),
                )
                .into(),
            ));
        }
        Ok(Message::Got(Received {
            bytes: msg.bytes,
            flags: msg.flags,
            fds,
        }))
    }

    /// Validates one reply message (`message`, received with `flags` and `fds` fds attached)
    /// against the ids not yet answered (`pending`): whole, of this protocol version, served
    /// (a refusal or another version is an [`FdPassError`]), its entries the next ids asked
    /// for, each offered ([`FdPassError::NotOffered`] names the first that is not), and one fd per
    /// entry. Returns how many ids it answers.
    fn check_reply(
        &self,
        message: &[u8],
        flags: ReturnFlags,
        fds: usize,
        pending: &[u32],
        server: PeerCred,
    ) -> Result<usize> {
        let (exporter, euid) = (self.exporter, self.euid);
        if flags.intersects(ReturnFlags::TRUNC | ReturnFlags::CTRUNC) {
            return Err(self.malformed("truncated message".to_string()));
        }
        let reply = decode_reply(message).map_err(|why| self.malformed(why))?;
        match reply.status {
            REQUEST_OK if reply.version == PROTOCOL_VERSION => {}
            REQUEST_REFUSED => {
                return Err(Error::FdPass(FdPassError::Refused {
                    reason: format!(
                        "process {} (uid {}) serves its fds only to its own user and root, and \
                         this process runs as uid {}",
                        exporter.pid, server.uid, euid
                    ),
                }));
            }
            REQUEST_VERSION | REQUEST_OK => {
                return Err(Error::FdPass(FdPassError::VersionMismatch {
                    found: u32::from(reply.version),
                    supported: u32::from(PROTOCOL_VERSION),
                }));
            }
            other => {
                return Err(self.malformed(format!("the server answered status {other}")));
            }
        }
        let expected = pending.get(..reply.entries.len());
        let entry_ids = reply.entries.iter().map(|(id, _)| *id);
        if reply.entries.is_empty() || !expected.is_some_and(|e| e.iter().copied().eq(entry_ids)) {
            return Err(self.malformed("the entries do not match the ids asked for".to_string()));
        }
        if let Some((id, _)) = reply.entries.iter().find(|(_, st)| *st != ENTRY_OK) {
            return Err(Error::FdPass(FdPassError::NotOffered {
                pid: exporter.pid,
                id: *id,
                reason: "withdrawn, or never exported",
            }));
        }
        if fds != reply.entries.len() {
            return Err(self.malformed(format!(
                "{} fds attached for {} ids",
                fds,
                reply.entries.len()
            )));
        }
        Ok(reply.entries.len())
    }
}
