//! Shared-memory primitives: named POSIX segments, shared futex words, and a seqlock over atomic
//! payload words.
//!
//! Owns: [`Segment`] (`shm_open` + `ftruncate` + `fallocate` + [`memmap2::MmapRaw`]), [`futex`]
//! (shared `FUTEX_WAIT`/`FUTEX_WAKE` with timeouts), [`seqlock`], and the versioned create/open
//! protocol of a named segment (`versioned`, crate-internal: magic, layout version, init stamp,
//! generation, the bounded wait, the replacement of a stale segment), and the listing of what stands
//! under this crate's names in `/dev/shm` (`listing`: names, owners, kinds, and the files of given
//! inodes, nothing opened). The registry and the channel
//! layer build their segments on these. Never calls CUDA; of a segment's contents it reads only
//! the protocol's words (magic, version, stamp, generation), where the layout says they are.
//!
//! Errors: [`ShmError`] is this layer's own (a segment missing, taken, of another user, not a
//! file, sparse or too small; a seqlock read that never found a stable copy). Functions return
//! [`crate::Result`], whose [`crate::Error::Shm`] carries it; the registry and the channel pass it
//! on unchanged rather than wrapping it again, so a user matches one pattern per failure
//! (`Error::Shm(ShmError::NotFound { .. })`) whichever layer opened the segment. System calls that
//! fail otherwise are [`crate::Error::Os`]; a symbolic link under a segment's name is
//! [`ShmError::NotASegment`], as a FIFO is (never followed), and a length of 0 is
//! [`crate::Error::InvalidArgument`]. Imports only `error` and `sync`: nothing of the registry or
//! the channel.
//!
//! Rule for everything here: bytes of a segment are read and written through atomics or raw
//! pointers only, never through Rust references to plain bytes, because another process may write
//! them at any moment.

mod error;
pub(crate) mod futex;
mod listing;
mod segment;
pub(crate) mod seqlock;
pub(crate) mod versioned;

pub use error::ShmError;
pub use futex::WaitResult;
pub use listing::list_segments;
pub(crate) use listing::{
    file_kind, list_names, list_other_users_names, list_own_names, names_of_inodes,
    other_users_name,
};
pub use segment::{
    MAX_SEGMENT_NAME, SHM_DIR, SIZING_LOCK_OFFSET, Segment, SegmentInfo, SegmentOptions,
    validate_name,
};
pub use seqlock::{SeqLock, SeqWriter};
pub use versioned::new_generation;
