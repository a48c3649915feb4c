//! Shared-memory primitives: named POSIX segments, shared futex words, and a seqlock over atomic
//! payload words.
//!
//! Owns: [`Segment`] (`shm_open` + `ftruncate` + `fallocate` + [`memmap2::MmapRaw`]), [`futex`]
//! (shared `FUTEX_WAIT`/`FUTEX_WAKE` with timeouts) and [`seqlock`]. The registry and the channel
//! layer build their segments on these. Never calls CUDA, never interprets a segment's contents.
//!
//! Errors: [`ShmError`] is this layer's own (a segment missing, taken, of another user, not a
//! file, sparse or too small; a seqlock read that never found a stable copy). Functions return
//! [`crate::Result`], whose [`crate::Error::Shm`] carries it; the registry and the channel pass it
//! on unchanged rather than wrapping it again, so a user matches one pattern per failure
//! (`Error::Shm(ShmError::NotFound { .. })`) whichever layer opened the segment. System calls that
//! fail otherwise are [`crate::Error::Os`]; a symbolic link under a segment's name and a length of 0
//! are [`crate::Error::InvalidArgument`]. Imports only `error` and `sync`: nothing of the registry
//! or the channel.
//!
//! Rule for everything here: bytes of a segment are read and written through atomics or raw
//! pointers only, never through Rust references to plain bytes, because another process may write
//! them at any moment.

mod error;
pub mod futex;
mod segment;
pub mod seqlock;

pub use error::ShmError;
pub use futex::WaitResult;
pub use segment::{
    MAX_SEGMENT_NAME, SHM_DIR, Segment, SegmentInfo, SegmentOptions, list_segments, validate_name,
};
pub use seqlock::{SeqLock, SeqWriter};

/// A new creation generation for a segment header: 64 random bits from the kernel (`getrandom`),
/// never 0 (0 means "no generation" in a header). Two creations under one name get different
/// generations with probability 1 − 2⁻⁶⁴, so a reader that finds another generation behind the
/// name knows its mapping was superseded.
pub fn new_generation() -> u64 {
    let mut b = [0u8; 8];
    let mut filled = 0;
    while filled < b.len() {
        match rustix::rand::getrandom(&mut b[filled..], rustix::rand::GetRandomFlags::empty()) {
            Ok(n) => filled += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(_) => break,
        }
    }
    let mut g = u64::from_le_bytes(b);
    if filled < b.len() {
        // No getrandom (a seccomp filter): time and pid still differ between two creations.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        g ^= t ^ (u64::from(std::process::id()) << 40);
    }
    if g == 0 { 1 } else { g }
}
