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
//! - An importer calls [`fetch`] or [`fetch_many`] with the exporter's [`ProcessIdentity`]. It
//!   first connects without waiting; a listener whose `SO_PEERCRED` has the exporter's pid and the
//!   importer's uid (the exporter's, where the caller knows it), at a path that is a socket of
//!   that uid (`lstat` after connecting: `connect` follows a symbolic link), passes the check
//!   below in either pid namespace case and is taken at once. Otherwise, or where that connection is refused or
//!   would wait, it looks at the socket path without following it (`lstat`: anything but a
//!   socket is refused at once, so a FIFO, file, directory or symbolic link planted there gives
//!   an error, never a hang), connects, checks who listens (below); then it sends the ids and receives one status per id and the
//!   fds (`SCM_RIGHTS`, at most 253 per message, `MSG_CMSG_CLOEXEC`). Whether the exporter still
//!   runs ([`ProcessIdentity::liveness`]: right across pid namespaces; zombies are dead) is asked
//!   when a step fails, every 100 ms while a step waits (a listener inherited by a forked child
//!   outlives the exporter but never answers), and before the fds are read when the listener's
//!   uid is neither this process's nor root's: a dead exporter is [`FdPassError::PeerGone`]. The
//!   `pidfd_getfd` transports ask it first.
//! - The server authorises each client with `SO_PEERCRED`: the same effective uid as the exporter's,
//!   or root. Others get a refusal status and no fds (the file's mode 0600 keeps processes of other
//!   users, root aside, from connecting at all). An unknown or withdrawn id gets an error status, never
//!   another fd. Accepted connections have 1 s send and receive timeouts, so a client that stalls or
//!   vanishes delays others by at most that; malformed requests get an error status. An importer
//!   whose request came later than that (a loaded machine) finds its connection closed unanswered
//!   and asks again over a new one, three connections in all, within its timeout.
//!
//! # Who listens: the importer's check
//! - Exporter in the importer's pid namespace ([`ProcessIdentity::in_own_pid_namespace`]): the
//!   listener's `SO_PEERCRED` pid must be the exporter's pid. A pid can be reused once its
//!   process is gone, so a listener whose uid is neither the importer's nor root's (an importer
//!   running as root) is taken for the exporter only while the exporter's liveness (pid and
//!   start time) says it runs, asked after the connection is made and before the fds are read.
//! - Exporter in another pid namespace: pids cannot be compared (`SO_PEERCRED` reports the pid as
//!   seen from the importer's namespace, 0 when the listener is not visible there). Instead the
//!   listener's uid must be the importer's effective uid or root, and the socket file must be owned
//!   by that same uid. `/dev/shm` is sticky, so only that uid (or root) can have put or replaced the
//!   file; the owner is checked before connecting and again against the listener's credentials.
//!   An importer running as root accepts a listener of any one uid there, and the exporter's
//!   liveness across pid namespaces is its liveness lock, which a process of any user can hold
//!   under a dead exporter's name: a token records no uid of its exporter to compare with, so a
//!   root importer across pid namespaces trusts whoever serves a dead exporter's path under one
//!   uid. Run importers as the exporters' user. A caller that knows the exporter's uid (the owner
//!   of a segment the exporter made, which it checked) passes it to [`fetch_many_from_uid`]: the
//!   file, the listener and the liveness lock must then be that uid's, root's importer included.
//!   Tensor sets do (their manifest is the reader's uid's, their holders' uids are recorded).
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
//!
//! # Files
//! `server.rs`: [`FdExport`], the table of offered fds, the server thread and its socket file.
//! `fetch.rs`: [`fetch`], [`fetch_many`], [`FdTransport`] and the socket transport, step by step.
//! `pidfd.rs`: the `pidfd_getfd` transport and [`pidfd_getfd_available`]. `socket.rs`: the socket
//! path, `SO_PEERCRED`, and dead servers' socket files. `wire.rs`: the request and reply bytes,
//! the protocol version and the status codes (the byte layout is documented there). `fetch.rs`
//! uses `pidfd.rs`; `server.rs` and `fetch.rs` both use `socket.rs` and `wire.rs`, and neither
//! uses the other. `error.rs`: [`FdPassError`], what a fetch reports (the exporter gone, the fd
//! not offered, a refusal, another protocol version, something else at the socket path).
//!
//! [`Error::Unsupported`]: crate::Error::Unsupported
//! [`fetch`]: fetch()

mod error;
mod fetch;
mod pidfd;
mod server;
mod socket;
mod wire;

pub use error::FdPassError;
pub(crate) use fetch::{FETCH_STEPS, FetchStep, fetch_many_then, fetch_times_on_this_thread};
pub use fetch::{FdTransport, fetch, fetch_many, fetch_many_from_uid};
pub use pidfd::pidfd_getfd_available;
pub use server::FdExport;
pub(crate) use server::own_offered;
pub use socket::{
    SOCKET_PREFIX, StaleSocketFile, remove_stale_socket_file, socket_path, stale_socket_files,
};

use crate::identity::{Liveness, ProcessIdentity};

/// Whether the exporter no longer runs ([`ProcessIdentity::liveness`]: its liveness lock is free, or
/// by `/proc` in this pid namespace; a zombie counts as dead). `Unknown` counts as running. With
/// the exporter's `uid` known, a liveness lock file counts only if that uid (or root) owns it
/// ([`ProcessIdentity::liveness_as`]).
fn exporter_gone(exporter: &ProcessIdentity, uid: Option<u32>) -> bool {
    match uid {
        Some(uid) => exporter.liveness_as(uid) == Liveness::Dead,
        None => exporter.liveness() == Liveness::Dead,
    }
}

#[cfg(test)]
mod tests {
    //! The two halves together, within one process: this process's server answers its own fetches.

    use super::*;
    use crate::error::Error;
    use std::io::{Read, Seek, Write};
    use std::os::fd::{AsRawFd, OwnedFd};
    use std::time::Duration;

    const T: Duration = Duration::from_secs(5);

    fn memfd(content: &str) -> OwnedFd {
        let fd = rustix::fs::memfd_create("fdpass-test", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        let mut f = std::fs::File::from(fd);
        f.write_all(content.as_bytes()).unwrap();
        f.into()
    }

    /// The whole text of the file `fd` refers to, read from its start.
    pub(super) fn content(fd: OwnedFd) -> String {
        let mut f = std::fs::File::from(fd);
        f.rewind().unwrap();
        let mut s = String::new();
        f.read_to_string(&mut s).unwrap();
        s
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
    fn own_offered_copies_a_live_export_and_not_a_withdrawn_one() {
        let a = FdExport::new(memfd("gamma")).unwrap();
        let id = a.id();
        let copy = own_offered(id).unwrap().expect("offered");
        assert_ne!(
            copy.as_raw_fd(),
            a.raw_fd(),
            "a copy, not the export's own fd"
        );
        assert_eq!(content(copy), "gamma");
        drop(a);
        assert!(own_offered(id).unwrap().is_none(), "withdrawn");
        assert!(own_offered(u32::MAX).unwrap().is_none(), "never made");
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
            matches!(e, Error::FdPass(FdPassError::NotOffered { id, .. }) if id == gone_id),
            "{e}"
        );
        let e = fetch_many(
            &me,
            &[(keep.id(), keep.raw_fd()), (u32::MAX, 0)],
            FdTransport::Socket,
            T,
        )
        .unwrap_err();
        assert!(
            matches!(
                e,
                Error::FdPass(FdPassError::NotOffered { id: u32::MAX, .. })
            ),
            "{e}"
        );
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
            assert!(
                matches!(e, Error::FdPass(FdPassError::PeerGone { .. })),
                "{t:?}: {e}"
            );
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
