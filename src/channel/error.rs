//! The channel layer's error type.

/// Errors of the channel layer: what its own segments' contents and its protocol report.
///
/// What the segment under a channel reports (another user's, not a file, sparse, too small) comes
/// as [`Error::Shm`], unwrapped, as from any other opener of a segment; a channel name without a
/// segment is [`ChannelError::NotFound`].
///
/// [`Error::Shm`]: crate::Error::Shm
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChannelError {
    /// No channel of this name exists (no producer created it, or it was closed).
    #[error("no channel named {0:?} (start its producer first)")]
    NotFound(String),
    /// A live producer already serves this channel name.
    #[error("channel {channel:?} already has a live producer (pid {pid})")]
    AlreadyExists {
        /// The channel name.
        channel: String,
        /// The live producer's pid.
        pid: u32,
    },
    /// Every consumer slot is taken.
    #[error("all {0} consumer slots of the channel are taken")]
    NoConsumerSlot(usize),
    /// The control segment is foreign, of another version, truncated or corrupted.
    #[error("bad channel segment: {0}")]
    BadSegment(String),
    /// This consumer's slot was taken back (the producer judged it dead, or it detached).
    #[error("this consumer was detached from the channel")]
    Detached,
    /// The channel's segment has another layout version than this build reads: a producer or
    /// consumer of another cuda-ipc version. Never replaced automatically, since its producer may
    /// be alive (its liveness cannot be read in a layout this build does not know).
    #[error(
        "channel {channel:?} has layout version {found}, this build reads version {supported}; \
         stop its producer (another cuda-ipc version), or remove /dev/shm/cuda-ipc.ch.{channel} if it is gone"
    )]
    VersionMismatch {
        /// The channel name.
        channel: String,
        /// The version in the segment.
        found: u32,
        /// The version this build reads.
        supported: u32,
    },
    /// Another process is creating this channel right now (its segment is younger than 2 s and
    /// not finished).
    #[error("channel {0:?} is being created by another process; try again")]
    CreationInProgress(String),
    /// The channel's name now stands for another segment than the one this handle attached to
    /// (it was removed and made again, e.g. by a restarted producer after `cuda-ipc gc`). Attach
    /// again.
    #[error("channel {0:?} was superseded: its segment was removed and made again; attach again")]
    Superseded(String),
    /// The pool would exceed the memory quota the user set.
    #[error("a pool of {buffers} × {buffer_bytes} bytes exceeds the quota of {quota} bytes")]
    OverQuota {
        /// Buffers asked for.
        buffers: usize,
        /// Bytes per buffer.
        buffer_bytes: usize,
        /// The quota in bytes.
        quota: u64,
    },
}
