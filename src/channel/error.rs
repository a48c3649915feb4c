//! The channel layer's error type: [`ChannelError`], and what was wrong with a segment
//! ([`SegmentFault`]).

use std::time::Duration;

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
    /// The control segment or the host pool is foreign, of another version, truncated, corrupted
    /// or does not match its channel: what was wrong is the [`SegmentFault`].
    #[error("bad channel segment: {0}")]
    BadSegment(SegmentFault),
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
    /// The pool would exceed the producer's own cap on its pool
    /// ([`ChannelOptions::quota_bytes`](super::ChannelOptions::quota_bytes)). Not the budget
    /// shared across processes ([`crate::quota::QuotaError::OverQuota`]).
    #[error(
        "a pool of {buffers} × {} exceeds the quota of {}",
        crate::error::bytes(.buffer_bytes),
        crate::error::bytes(.quota)
    )]
    PoolOverCap {
        /// Buffers asked for.
        buffers: usize,
        /// Bytes per buffer.
        buffer_bytes: usize,
        /// The cap in bytes.
        quota: u64,
    },
    /// The channel's producer process died (found by pid + start time); no more frames will come.
    #[error("the producer (pid {pid}) is gone")]
    ProducerGone {
        /// The producer's pid.
        pid: u32,
    },
    /// The producer closed the channel and every frame it published was delivered.
    #[error("the channel was closed by its producer")]
    Closed,
}

/// What was wrong with a channel's segment (the control segment `cuda-ipc.ch.NAME` or the host pool
/// `cuda-ipc.hp.NAME`), as [`ChannelError::BadSegment`] carries it. `segment` is the segment's
/// name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SegmentFault {
    /// Another program's segment: its magic is not the channel's (`what`: `"channel"`, `"host
    /// pool"`, or `"tensor set's generation channel"` for `cuda-ipc.tg.NAME`).
    #[error("{segment} is not a cuda-ipc {what} (magic {magic:#018x})")]
    Foreign {
        /// The segment's name.
        segment: String,
        /// Which of the channel's segments was expected.
        what: &'static str,
        /// The magic found.
        magic: u64,
    },
    /// A host pool of another layout version (the control segment's is
    /// [`ChannelError::VersionMismatch`]).
    #[error("{segment} has pool layout version {found}, this build reads version {supported}")]
    PoolVersion {
        /// The segment's name.
        segment: String,
        /// The version found.
        found: u32,
        /// The version this build reads.
        supported: u32,
    },
    /// Its creator never finished it: no init stamp after `waited`.
    #[error(
        "{segment} was never finished by its creator (no init stamp after {})",
        waited_text(*.waited)
    )]
    Unfinished {
        /// The segment's name.
        segment: String,
        /// How long the opener waited for the stamp.
        waited: Duration,
    },
    /// A segment whose init stamp is 0 though the creator it records runs and had recorded
    /// itself at least 500 ms before the opener's wait of `waited` ended: not a creation in
    /// progress (one stamps within milliseconds of recording its creator) but a header
    /// overwritten since its creation (its stamp zeroed), or a creator stopped.
    #[error(
        "{segment} has no init stamp after {} though the producer it records runs (a creation \
         stamps within milliseconds): the header was overwritten, or its producer is stopped",
        waited_text(*.waited)
    )]
    Overwritten {
        /// The segment's name.
        segment: String,
        /// How long the opener waited for the stamp.
        waited: Duration,
    },
    /// A segment whose init stamp is 0 but that shows use which only follows the stamp (a frame
    /// published, a buffer claimed, a consumer attached, a close): no creation, abandoned or in
    /// progress, but a segment in use whose header was overwritten (its stamp zeroed, whatever
    /// producer it records, by a peer that maps it writable). Never removed, by a new producer
    /// or by `cuda-ipc gc`: left as it is.
    #[error(
        "{segment} is a {what} in use whose header was overwritten: its init stamp is 0, yet it \
         shows use that only follows the stamp (a frame published, a buffer claimed, a consumer \
         attached or a close); left as it is"
    )]
    OverwrittenInUse {
        /// The segment's name.
        segment: String,
        /// What it is: `channel`, or `tensor set's generation channel`.
        what: &'static str,
    },
    /// A creation abandoned half-way: no init stamp, and its creator is dead, or none is recorded
    /// in a segment 2 s old by `st_ctime`'s whole seconds (told at once by every opener, a
    /// consumer's attach and the tools alike, or as soon as it comes of age by one already
    /// waiting; `cuda-ipc gc` removes it).
    #[error(
        "{segment} is a creation abandoned half-way: no init stamp, and its creator died (or never \
         recorded itself in 2 s); `cuda-ipc gc` removes it"
    )]
    Abandoned {
        /// The segment's name.
        segment: String,
    },
    /// The control header's counts are out of range.
    #[error("{segment} claims {buffers} buffers and {consumers} consumers: corrupted")]
    Counts {
        /// The segment's name.
        segment: String,
        /// The buffer count it claims.
        buffers: usize,
        /// The consumer count it claims.
        consumers: usize,
    },
    /// The control segment, or a host pool whose header matches its channel, is shorter than its
    /// header's counts need (cut short by `truncate`, or corrupted).
    #[error(
        "{segment} holds {} but its header's counts need {need}: truncated or corrupted",
        crate::error::bytes(.len)
    )]
    Truncated {
        /// The segment's name.
        segment: String,
        /// Its length in bytes.
        len: usize,
        /// The length its counts need, in bytes.
        need: usize,
    },
    /// The control header's size word (`segment_bytes`) is not the size its counts need.
    #[error(
        "{segment} records a size of {} in its header, but its {buffers} buffers and \
         {consumers} consumers need {need} (the file holds {len}): corrupted",
        crate::error::bytes(.recorded)
    )]
    SizeWord {
        /// The segment's name.
        segment: String,
        /// The size word its header records, in bytes.
        recorded: u64,
        /// The buffer count it claims.
        buffers: usize,
        /// The consumer count it claims.
        consumers: usize,
        /// The size those counts need, in bytes.
        need: usize,
        /// The file's length in bytes.
        len: usize,
    },
    /// The channel's host pool is missing.
    #[error("the host pool {segment} of channel {channel:?} is missing")]
    PoolMissing {
        /// The pool's segment name.
        segment: String,
        /// The channel name.
        channel: String,
    },
    /// The host pool's geometry does not match its channel's header.
    #[error(
        "{segment} ({buffers} buffers of {buffer_bytes} bytes, stride {stride}, {mapped} bytes \
         mapped) does not match its channel ({channel_buffers} buffers of {channel_buffer_bytes} \
         bytes)"
    )]
    PoolMismatch {
        /// The pool's segment name.
        segment: String,
        /// Buffers the pool's header claims.
        buffers: usize,
        /// Bytes per buffer the pool's header claims.
        buffer_bytes: u64,
        /// The pool's stride between buffers, in bytes.
        stride: u64,
        /// Bytes mapped.
        mapped: usize,
        /// Buffers the channel's header names.
        channel_buffers: usize,
        /// Bytes per buffer the channel's header names.
        channel_buffer_bytes: u64,
    },
    /// An imported buffer's length differs from the channel header's buffer size.
    #[error("buffer {index} holds {}, the header says {expected}", crate::error::bytes(.len))]
    BufferLen {
        /// The buffer's index in the pool.
        index: usize,
        /// Its length in bytes.
        len: usize,
        /// The header's buffer size in bytes.
        expected: u64,
    },
}

/// A wait as the messages name it: whole seconds as `2 s`, else milliseconds.
fn waited_text(d: Duration) -> String {
    if d.subsec_nanos() == 0 {
        format!("{} s", d.as_secs())
    } else {
        format!("{} ms", d.as_millis())
    }
}

/// Whether `e` says that nothing stands under the name: a missing segment
/// ([`crate::shm::ShmError::NotFound`]), or the same in the channel's words
/// ([`ChannelError::NotFound`], as a channel's openers tell it).
pub(crate) fn is_not_found(e: &crate::Error) -> bool {
    matches!(
        e,
        crate::Error::Shm(crate::shm::ShmError::NotFound { .. })
            | crate::Error::Channel(ChannelError::NotFound(_))
    )
}
