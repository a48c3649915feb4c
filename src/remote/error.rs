//! [`RemoteError`]: what the remote lane reports (NIXL calls, the control connection, a peer that
//! broke the protocol, refused us or is busy). It reaches users as [`crate::Error::Remote`].

/// What went wrong on the lane.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RemoteError {
    /// A NIXL C API call failed; `reason` is what `nixl-sys` reported.
    #[error("{call} failed: {reason}")]
    Nixl {
        /// The NIXL C API call.
        call: &'static str,
        /// What `nixl-sys` reported.
        reason: String,
    },
    /// The control connection failed or the peer closed it.
    #[error("the lane's control connection: {0}")]
    Link(String),
    /// The peer sent what the protocol does not allow.
    #[error("the lane's peer broke the protocol: {0}")]
    Protocol(String),
    /// The peer refused us, or we refused it (wrong secret, another version, another layout):
    /// trying again changes nothing.
    #[error("the lane's peer was refused: {0}")]
    Refused(String),
    /// The receiving bridge serves another sender now (or has not yet seen that its last one is
    /// gone: a stopped bridge continued, a link lost a moment ago): try again shortly.
    #[error("the receiving bridge is busy: {0}")]
    Busy(String),
}

/// How a receiving bridge's refusal of a sender because it serves another one begins (the rest
/// names the channel or set); the sender makes it [`RemoteError::Busy`].
pub(crate) const BUSY: &str = "busy: ";

impl RemoteError {
    /// The error for a peer's `Refused` message: [`RemoteError::Busy`] when the receiving bridge
    /// serves another sender (a passing state), else [`RemoteError::Refused`].
    pub(crate) fn refused(reason: String) -> RemoteError {
        if reason.starts_with(BUSY) {
            RemoteError::Busy(reason)
        } else {
            RemoteError::Refused(reason)
        }
    }
}
