//! The `pidfd_getfd` transport: copying an fd straight out of the exporter's fd table, subject to
//! the ptrace access rules and only within one pid namespace.
//!
//! Owns: the probe ([`pidfd_getfd_available`]), the sorting of `pidfd_open` / `pidfd_getfd`
//! errors into "use the socket instead" and real failures ([`PidfdFailure`]), and the fetch itself
//! ([`fetch_pidfd`]). Knows nothing of the socket or the wire format; `fetch.rs` decides when to
//! use it and when to fall back.
//!
//! Who closes what: the pidfd is this module's and is closed before [`fetch_pidfd`] returns; the
//! fds it returns are the caller's, and on an error the ones taken so far are closed (dropped)
//! here, so none is left open.

use super::error::FdPassError;
use super::exporter_gone;
use crate::error::{Error, OsError};
use crate::identity::ProcessIdentity;
use rustix::io::Errno;
use std::os::fd::OwnedFd;

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
pub(super) enum PidfdFailure {
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
    pub(super) fn describe(&self) -> String {
        match self {
            PidfdFailure::Unavailable(r) => r.clone(),
            PidfdFailure::BadFd { id, raw_fd } => {
                format!("fd {raw_fd} of export {id} is not open in the exporter")
            }
            PidfdFailure::Gone => "the process is gone".to_string(),
            PidfdFailure::Other(e) => e.to_string(),
        }
    }

    pub(super) fn into_error(self, exporter: &ProcessIdentity) -> Error {
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
            PidfdFailure::BadFd { id, .. } => Error::FdPass(FdPassError::NotOffered {
                pid: exporter.pid,
                id,
                reason: "its fd number is not open in the exporter (withdrawn)",
            }),
            PidfdFailure::Gone => Error::FdPass(FdPassError::PeerGone { pid: exporter.pid }),
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
pub(super) fn fetch_pidfd(
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
    if exporter_gone(exporter, None) {
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
            Err(_) if exporter_gone(exporter, None) => return Err(PidfdFailure::Gone),
            Err(Errno::BADF) => return Err(PidfdFailure::BadFd { id, raw_fd }),
            Err(e) => return Err(pidfd_getfd_failure(exporter.pid, e)),
        }
    }
    Ok(out)
}
