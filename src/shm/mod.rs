//! Shared-memory primitives: named POSIX segments, shared futex words, and a seqlock over atomic
//! payload words.
//!
//! Owns: [`Segment`] (`shm_open` + `ftruncate` + `fallocate` + [`memmap2::MmapRaw`]), [`futex`]
//! (shared `FUTEX_WAIT`/`FUTEX_WAKE` with timeouts) and [`seqlock`]. The registry and the channel
//! layer build their segments on these. Never calls CUDA, never interprets a segment's contents.
//!
//! Rule for everything here: bytes of a segment are read and written through atomics or raw
//! pointers only, never through Rust references to plain bytes, because another process may write
//! them at any moment.

pub mod futex;
mod segment;
pub mod seqlock;

pub use futex::WaitResult;
pub use segment::{
    MAX_SEGMENT_NAME, SHM_DIR, Segment, SegmentOptions, list_segments, validate_name,
};
pub use seqlock::{SeqLock, SeqWriter};
