//! Fd passing's own error: what a fetch from another process's fd server reports.

/// What fetching a file descriptor from another process ([`super::fetch()`], [`super::fetch_many`])
/// reports, besides a failed system call ([`crate::Error::Os`]), a deadline that ran out
/// ([`crate::Error::Timeout`]), a bad argument and `pidfd_getfd` refused
/// ([`crate::Error::Unsupported`], [`super::FdTransport::PidfdOnly`]).
///
/// `Display` text is lower case without a final period; a refusal names the reason and the fix.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum FdPassError {
    /// The process that exported the fd is gone (by pid + start time + boot id, or it is a
    /// zombie), so nothing more can be fetched from it. Fds fetched before stay valid.
    #[error("the exporting process (pid {pid}) is gone")]
    PeerGone {
        /// The exporter's pid.
        pid: u32,
    },
    /// A running process does not offer the fd asked for: the export was withdrawn or never made,
    /// or the process serves no fds at all.
    #[error("process {pid} does not offer fd export {id}: {reason}")]
    NotOffered {
        /// The exporter's pid.
        pid: u32,
        /// The export id asked for.
        id: u32,
        /// Why, in words.
        reason: &'static str,
    },
    /// The exporter serves its fds to its own user and root only, and this process is neither
    /// (its socket file's mode refused the connection, or its server refused the request).
    #[error(
        "fd passing is not supported here: {reason}; run the exporter and the importer as the \
         same user"
    )]
    Refused {
        /// Who refused whom, with the uids.
        reason: String,
    },
    /// What is at the exporter's socket path is not the exporter's fd server: not a socket, a
    /// socket listened on by another process, or (across pid namespaces) a file or listener of
    /// another user. Nothing was sent to it.
    #[error("fd passing is not supported here: {reason}; {fix}")]
    NotTheExporter {
        /// What was found, and where.
        reason: String,
        /// What to do about it.
        fix: &'static str,
    },
    /// The exporter speaks another version of the fd-passing protocol (another cuda-ipc version).
    #[error(
        "fd passing is not supported here: the exporter speaks fd-passing protocol version \
         {found}, this process {supported}; use the same cuda-ipc version in both processes"
    )]
    VersionMismatch {
        /// The exporter's version.
        found: u32,
        /// This build's version.
        supported: u32,
    },
}
