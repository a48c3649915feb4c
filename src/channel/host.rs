//! The host-memory pool of a channel ([`super::MemoryKind::Host`]): the buffers live in one POSIX
//! shared-memory segment of their own, `/dev/shm/cuda-ipc.hp.NAME`, beside the control segment
//! `cuda-ipc.ch.NAME`. Never calls CUDA.
//!
//! Layout (little-endian, `#[repr(C)]`): a [`PoolHeader`] on the first page (magic `CIPCPOOL`, pool
//! layout version, init stamp written last, buffer count, bytes per buffer, stride, segment bytes,
//! a random generation, the producer's identity words), then buffer `i` at
//! `POOL_DATA + i * stride` (`stride`: `buffer_bytes` rounded up to 4096, so every buffer is page
//! aligned). A buffer's token (kind [`TokenKind::HostMemory`]) carries the pool's generation in its
//! first 8 handle bytes and the buffer's byte offset and length; a consumer maps the pool by the
//! channel's name and checks that the generation, the count and the size agree with the control
//! segment's tokens before it reads a byte.
//!
//! Why its own segment and not the control segment: the control layout (also read by the Python
//! consumer) stays as it is; the pool can be of any size without moving the ready page;
//! and a GPU channel pays nothing. Why `cuda-ipc.hp.NAME` and not `cuda-ipc.ch.NAME.pool`: the
//! latter is the control segment of a channel named `NAME.pool`, and it would not fit the name
//! limit for the longest channel names.
//!
//! Ordering: the bytes are written and read with plain (non-atomic) copies through raw pointers;
//! the channel's protocol orders them (docs/ARCHITECTURE.md, pairing table): the producer's writes
//! happen before a consumer's reads through `publish`'s Release store of `seq` and `try_take`'s
//! Acquire load of it; a consumer's reads happen before the producer's next write through the
//! consumer's `hold_mask` clear (SeqCst read-modify-write, a release) and the producer's SeqCst load
//! of `hold_mask` in `try_acquire` (an acquire) that sees it clear.

use super::SegmentFault;
use super::control::{Control, segment_name};
use super::layout::STAMP_READY;
use crate::error::{Error, Result};
use crate::identity::{Liveness, ProcessIdentity};
use crate::shm::ShmError;
use crate::shm::versioned::{
    self, Blocker, Creator, HeaderError, OpenError, StampWord, VersionedHeader,
};
use crate::shm::{Segment, SegmentOptions};
use crate::sync::{AtomicU32, AtomicU64, Ordering};
use crate::token::{Token, TokenKind};
use std::time::Duration;

/// Magic at offset 0 of a pool segment: `CIPCPOOL`.
const POOL_MAGIC: u64 = u64::from_le_bytes(*b"CIPCPOOL");
/// Pool layout version; an opener refuses any other.
pub(crate) const POOL_VERSION: u32 = 2;
/// Offset of the first buffer: the header has the first page to itself.
pub(crate) const POOL_DATA: usize = 4096;
/// Prefix of a pool segment's name; the channel name follows.
pub(crate) const POOL_PREFIX: &str = "cuda-ipc.hp.";
/// How long a consumer waits for the stamp of a pool whose creator may still be writing it.
const POOL_INIT_WAIT: Duration = Duration::from_secs(2);

/// The pool segment's header.
#[repr(C)]
pub(crate) struct PoolHeader {
    magic: AtomicU64,
    version: AtomicU32,
    /// Written last at creation (Release); openers Acquire-load it before anything else.
    stamp: AtomicU32,
    buffers: AtomicU32,
    /// The producer's effective uid (pool version 2), written with its identity.
    producer_uid: AtomicU32,
    buffer_bytes: AtomicU64,
    stride: AtomicU64,
    segment_bytes: AtomicU64,
    /// Random, nonzero: the tokens in the control segment carry it.
    generation: AtomicU64,
    /// The producer, as `ProcessIdentity::store_words` writes it.
    producer: [AtomicU64; 4],
}

#[cfg(not(loom))] // loom atomics have other sizes; the mapped layout is only used without it
const _: () = assert!(size_of::<PoolHeader>() == 88);
#[cfg(not(loom))] // loom atomics have other sizes; the mapped layout is only used without it
const _: () = assert!(std::mem::offset_of!(PoolHeader, generation) == 48);
#[cfg(not(loom))] // as above
const _: () = assert!(std::mem::offset_of!(PoolHeader, producer_uid) == 20);
#[cfg(not(loom))] // as above
const _: () = assert!(std::mem::offset_of!(PoolHeader, producer) == 56);

// SAFETY: (1) `PoolHeader` is `#[repr(C)]` and all atomics; (2) its alignment is 8; (3) it is 88
// bytes, within the first page (`POOL_DATA`), which the header has to itself.
unsafe impl VersionedHeader for PoolHeader {
    const MAGIC: u64 = POOL_MAGIC;
    const VERSION: u32 = POOL_VERSION;
    const HEADER_LEN: usize = POOL_DATA;
    // The pool's opener has always waited for the stamp before it looked at the magic.
    const FOREIGN_BEFORE_STAMP: bool = false;

    fn magic(&self) -> &AtomicU64 {
        &self.magic
    }
    fn version(&self) -> &AtomicU32 {
        &self.version
    }
    fn stamp(&self) -> StampWord<'_> {
        StampWord::U32(&self.stamp, STAMP_READY)
    }
    fn generation(&self) -> &AtomicU64 {
        &self.generation
    }
}

/// The producer that the pool segment `seg` records, judged by the one rule of
/// [`Creator::judged`]: none recorded yet (pid 0), dead, or running (or whose liveness cannot be
/// told). For an opener of a pool that may lack its stamp.
fn creator_of(seg: &Segment) -> Creator {
    let h = versioned::header::<PoolHeader>(seg);
    // `load_words` Acquire-loads the pid word, which `store_words` stores last: never a torn
    // identity read as a dead producer's.
    let producer = ProcessIdentity::load_words(&h.producer);
    Creator::judged(
        producer.pid != 0,
        || {
            // Relaxed: a diagnosis of a segment without its stamp.
            producer.liveness_as(h.producer_uid.load(Ordering::Relaxed)) == Liveness::Dead
        },
        // No word of the pool shows use: after its stamp only frame bytes are written, which
        // may be zero. (Its channel's control segment, judged on its own, shows it.)
        || false,
    )
}

/// The pool segment name of a channel.
pub(crate) fn pool_name(channel: &str) -> String {
    format!("{POOL_PREFIX}{channel}")
}

fn bad(fault: SegmentFault) -> Error {
    Error::Channel(super::ChannelError::BadSegment(fault))
}

fn foreign(name: &str, magic: u64) -> Error {
    bad(SegmentFault::Foreign {
        segment: name.to_string(),
        what: "host pool",
        magic,
    })
}

fn other_version(name: &str, found: u32) -> Error {
    bad(SegmentFault::PoolVersion {
        segment: name.to_string(),
        found,
        supported: POOL_VERSION,
    })
}

/// A mapped host pool.
pub(crate) struct HostPool {
    seg: Segment,
    buffers: usize,
    buffer_bytes: usize,
    stride: usize,
    generation: u64,
}

// SAFETY: the mapping is process-wide and stays valid while `seg` lives; the header is touched
// through atomics only and the buffers through raw pointers whose accesses the channel protocol
// orders (module doc).
unsafe impl Send for HostPool {}
// SAFETY: as for Send; every method takes `&self` and hands out raw pointers, never references.
unsafe impl Sync for HostPool {}

impl HostPool {
    /// The stride (each buffer rounded up to 4096 bytes) and the segment's length in bytes of a
    /// pool of `buffers` buffers of `buffer_bytes` bytes. Checked before any system call sees a
    /// size (and before a producer asks the quota ledger for the pool's bytes): a buffer size
    /// near `usize::MAX` would round up past it, and a file (`off_t`) and a mapping (`isize`)
    /// hold at most `isize::MAX` bytes.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the buffers, their size and the limit past it.
    pub(crate) fn geometry(buffers: usize, buffer_bytes: usize) -> Result<(usize, usize)> {
        let sizes = buffer_bytes
            .checked_next_multiple_of(4096)
            .and_then(|stride| {
                buffers
                    .checked_mul(stride)
                    .and_then(|n| n.checked_add(POOL_DATA))
                    .filter(|&len| len <= isize::MAX as usize)
                    .map(|len| (stride, len))
            });
        sizes.ok_or_else(|| {
            Error::InvalidArgument(format!(
                "a host pool of {buffers} buffers of {buffer_bytes} bytes (each rounded up to \
                 4096) passes the most a segment can hold ({} bytes)",
                isize::MAX
            ))
        })
    }

    /// Creates the pool of `channel`: `buffers` buffers of `buffer_bytes` bytes, pages reserved.
    /// A pool left by a dead producer, or a creation abandoned half-way, is replaced; anything else
    /// under the name is a typed error and is left alone.
    pub(crate) fn create(
        channel: &str,
        buffers: usize,
        buffer_bytes: usize,
        opts: &SegmentOptions,
    ) -> Result<HostPool> {
        let name = pool_name(channel);
        let (stride, len) = Self::geometry(buffers, buffer_bytes)?;
        // As the control segment: only the pool judged is removed, under the replacers' lock, so
        // two producers restarting at once never remove each other's new pool.
        // Before the segment is made: the first call of a process creates its liveness file, whose
        // failure (a full /dev/shm) must not leave the new segment behind.
        let me = ProcessIdentity::current()?;
        let seg = versioned::create_replacing(&name, len, opts, "host pool segment", || {
            match Self::replaceable(channel) {
                Ok(why) => Ok(Some(why)),
                // Another replacer removed it meanwhile: create again.
                Err(Error::Shm(ShmError::NotFound { .. })) => Ok(None),
                Err(e) => Err(e),
            }
        })?;
        // SYNC POINT: pool stamp. Release, stored last by `write_versioned`: pairs with the
        // Acquire loads in `open` (`open_versioned`) and `replaceable`.
        let generation = versioned::write_versioned::<PoolHeader>(
            &seg,
            |h| {
                me.store_words(&h.producer);
                h.producer_uid
                    .store(rustix::process::geteuid().as_raw(), Ordering::Relaxed);
            },
            |h| {
                h.buffers.store(buffers as u32, Ordering::Relaxed);
                h.buffer_bytes.store(buffer_bytes as u64, Ordering::Relaxed);
                h.stride.store(stride as u64, Ordering::Relaxed);
                h.segment_bytes.store(len as u64, Ordering::Relaxed);
            },
        );
        Ok(HostPool {
            seg,
            buffers,
            buffer_bytes,
            stride,
            generation,
        })
    }

    /// Whether the pool segment of `channel` that blocks a creation may be replaced (and why), or
    /// the typed error naming what is there. Only this user's own pool segments are replaced, and
    /// of those only one whose producer is dead, or a creation abandoned half-way (empty, sparse or
    /// never stamped, 2 s old, no live creator recorded); never one whose channel's control segment
    /// has another layout version ([`super::ChannelError::VersionMismatch`]).
    pub(crate) fn replaceable(channel: &str) -> Result<&'static str> {
        // The pool is judged with its channel: when the control segment has another layout
        // version, the pool belongs to a channel this build cannot judge (the pool's own layout may
        // be the same in both versions), and another version's segments are never replaced or
        // removed.
        if let Err(e @ Error::Channel(super::ChannelError::VersionMismatch { .. })) =
            Control::replaceable(channel, &segment_name(channel))
        {
            return Err(e);
        }
        let name = pool_name(channel);
        let info = match versioned::stat_blocker(&name, POOL_DATA)? {
            Blocker::Abandoned => return Ok(versioned::ABANDONED_UNSIZED),
            Blocker::Young => {
                return Err(Error::Channel(super::ChannelError::CreationInProgress(
                    channel.to_string(),
                )));
            }
            Blocker::Sized(info) => info,
        };
        // Not `versioned::look`: this judgement refuses a foreign magic before it looks at the
        // stamp, while the pool's opener waits for the stamp first (`FOREIGN_BEFORE_STAMP`), and
        // it reads a stamped pool's magic 0 as no refusal; sharing one look would change which
        // error such a file gets.
        let seg = Segment::open_with_min_len(&name, POOL_DATA)?;
        let h = versioned::header::<PoolHeader>(&seg);
        let producer = ProcessIdentity::load_words(&h.producer);
        // Relaxed: before the stamp, a guess (a creator may be writing); read again below.
        let producer_uid = h.producer_uid.load(Ordering::Relaxed);
        let magic = h.magic.load(Ordering::Relaxed);
        if magic != POOL_MAGIC && magic != 0 {
            return Err(foreign(&name, magic));
        }
        // SYNC POINT: pool stamp. Acquire: pairs with the Release store of the stamp in `create`.
        if h.stamp.load(Ordering::Acquire) != STAMP_READY {
            if producer.pid != 0 && producer.liveness_as(producer_uid) != Liveness::Dead {
                return Err(Error::Channel(super::ChannelError::CreationInProgress(
                    channel.to_string(),
                )));
            }
            if info.age_secs >= versioned::ABANDONED_AFTER.as_secs() {
                return Ok("a creation abandoned before it was finished");
            }
            return Err(Error::Channel(super::ChannelError::CreationInProgress(
                channel.to_string(),
            )));
        }
        let v = h.version.load(Ordering::Relaxed);
        if v != POOL_VERSION {
            return Err(other_version(&name, v));
        }
        // Relaxed: ordered by the Acquire load of the stamp above (SYNC POINT: pool stamp).
        let producer = ProcessIdentity::load_words(&h.producer);
        let producer_uid = h.producer_uid.load(Ordering::Relaxed);
        match producer.liveness_as(producer_uid) {
            Liveness::Dead => Ok("its producer is dead"),
            _ => Err(Error::Channel(super::ChannelError::AlreadyExists {
                channel: channel.to_string(),
                pid: producer.pid,
            })),
        }
    }

    /// Maps the pool of `channel` for a consumer and checks it against `tokens` (one per buffer,
    /// from the control segment) and `buffer_bytes` (the control header's).
    pub(crate) fn open(
        channel: &str,
        allow_group: bool,
        tokens: &[Token],
        buffer_bytes: u64,
    ) -> Result<HostPool> {
        let name = pool_name(channel);
        // SYNC POINT: pool stamp. Acquire, in `open_versioned`'s look: pairs with the Release
        // store of the stamp in `create`; the fields read below are the creator's.
        // Its stamp is waited for only while its producer may still write it (one recorded that
        // runs, or none recorded yet in a pool younger than 2 s): a pool left unstamped by a
        // dead producer, or by none, is refused at once.
        let seg = versioned::open_versioned_unless_abandoned::<PoolHeader>(
            &name,
            allow_group,
            POOL_INIT_WAIT,
            creator_of,
        )
        .map_err(|e| match e {
            OpenError::Segment(Error::Shm(ShmError::NotFound { .. })) => {
                bad(SegmentFault::PoolMissing {
                    segment: name.clone(),
                    channel: channel.to_string(),
                })
            }
            OpenError::Segment(e) => e,
            OpenError::Header(HeaderError::Foreign { magic }) => foreign(&name, magic),
            OpenError::Header(HeaderError::OtherVersion { found }) => other_version(&name, found),
            // Never stamped, and never will be: a creation abandoned half-way, or another
            // program's file (its magic is looked at only once a pool is stamped).
            OpenError::Header(HeaderError::Abandoned) => {
                match Segment::open_with_min_len(&name, POOL_DATA).map(|seg| {
                    // Relaxed: a diagnosis of a segment without its stamp.
                    versioned::header::<PoolHeader>(&seg)
                        .magic
                        .load(Ordering::Relaxed)
                }) {
                    Ok(magic) if magic != 0 && magic != POOL_MAGIC => foreign(&name, magic),
                    _ => bad(SegmentFault::Abandoned {
                        segment: name.clone(),
                    }),
                }
            }
            // (Never from the pool's `creator_of`, which sees no use: named as the channel's.)
            OpenError::Header(HeaderError::InUse) => bad(SegmentFault::OverwrittenInUse {
                segment: name.clone(),
                what: "channel's host pool",
            }),
            // Waited for in vain while the producer it records ran: overwritten, not in
            // progress (`versioned::StampWait`).
            OpenError::Header(HeaderError::Overwritten { waited }) => {
                bad(SegmentFault::Overwritten {
                    segment: name.clone(),
                    waited,
                })
            }
            // (No `BadStamp`: the pool's stamp is not strict; a bad one is awaited.)
            OpenError::Header(_) => bad(SegmentFault::Unfinished {
                segment: name.clone(),
                waited: POOL_INIT_WAIT,
            }),
        })?;
        let h = versioned::header::<PoolHeader>(&seg);
        let buffers = h.buffers.load(Ordering::Relaxed) as usize;
        let bytes = h.buffer_bytes.load(Ordering::Relaxed);
        let stride = h.stride.load(Ordering::Relaxed);
        let generation = h.generation.load(Ordering::Relaxed);
        let need = (buffers as u64)
            .checked_mul(stride)
            .and_then(|n| n.checked_add(POOL_DATA as u64));
        let geometry = buffers == tokens.len()
            && bytes == buffer_bytes
            // A size near `u64::MAX` (another process's bytes) rounds up to nothing: a mismatch.
            && bytes.checked_next_multiple_of(4096) == Some(stride)
            && need.is_some_and(|n| n == h.segment_bytes.load(Ordering::Relaxed));
        // The channel's own pool, cut short of its buffers (`truncate`): said as such.
        if let Some(n) = need
            && geometry
            && n > seg.len() as u64
        {
            return Err(bad(SegmentFault::Truncated {
                segment: name,
                len: seg.len(),
                need: usize::try_from(n).unwrap_or(usize::MAX),
            }));
        }
        // A pool of another incarnation of the channel (a producer made it again meanwhile, with
        // another geometry: the control segment read is the old one's or the new one's): the
        // channel was superseded, a race to attach again, not a damaged pool.
        if tokens.iter().any(|t| token_generation(t) != generation) {
            return Err(Error::Channel(super::ChannelError::Superseded(
                channel.to_string(),
            )));
        }
        if !geometry {
            return Err(bad(SegmentFault::PoolMismatch {
                segment: name,
                buffers,
                buffer_bytes: bytes,
                stride,
                mapped: seg.len(),
                channel_buffers: tokens.len(),
                channel_buffer_bytes: buffer_bytes,
            }));
        }
        for (i, t) in tokens.iter().enumerate() {
            let off = POOL_DATA as u64 + i as u64 * stride;
            if t.kind != TokenKind::HostMemory
                || token_generation(t) != generation
                || t.offset != off
                || t.len != bytes
            {
                return Err(Error::Channel(super::ChannelError::Superseded(
                    channel.to_string(),
                )));
            }
        }
        Ok(HostPool {
            seg,
            buffers,
            buffer_bytes: bytes as usize,
            stride: stride as usize,
            generation,
        })
    }

    /// Buffer `i`'s first byte; valid for `buffer_bytes` bytes while `self` lives.
    pub(crate) fn ptr(&self, i: usize) -> *mut u8 {
        assert!(i < self.buffers, "buffer {i} of {}", self.buffers);
        // SAFETY: POOL_DATA + i * stride + buffer_bytes <= the mapped length (checked at
        // create/open), so the pointer stays inside the mapping.
        unsafe { self.seg.as_ptr().add(POOL_DATA + i * self.stride) }
    }

    pub(crate) fn buffer_bytes(&self) -> usize {
        self.buffer_bytes
    }

    /// The token of buffer `i`, as the producer stores it in the control segment.
    pub(crate) fn token(&self, i: usize, exporter: ProcessIdentity) -> Token {
        let mut handle = [0u8; 64];
        handle[..8].copy_from_slice(&self.generation.to_le_bytes());
        Token {
            kind: TokenKind::HostMemory,
            handle,
            offset: (POOL_DATA + i * self.stride) as u64,
            len: self.buffer_bytes as u64,
            device: crate::driver::Uuid([0; 16]),
            exporter,
            export_id: 0,
        }
    }

    /// The pool's segment (for the quota's record of where a reservation's bytes live).
    pub(crate) fn segment(&self) -> &Segment {
        &self.seg
    }

    /// Removes the pool's name if it still stands for this mapping (never another creator's).
    pub(crate) fn unlink(&self) {
        let name = self.seg.name();
        let Ok(mine) = self.seg.inode() else { return };
        if let Err(e) = Segment::unlink_if_same(name, mine) {
            tracing::warn!("unlinking {name}: {e}");
        }
    }
}

/// The pool generation a host-memory token carries.
pub(crate) fn token_generation(t: &Token) -> u64 {
    u64::from_le_bytes(t.handle[..8].try_into().unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pool_is_created_checked_against_its_tokens_and_refused_when_they_differ() {
        let ch = format!("hostpool-unit-{}", std::process::id());
        let p = HostPool::create(&ch, 3, 100, &SegmentOptions::new()).unwrap();
        let me = ProcessIdentity::current().unwrap();
        let tokens: Vec<Token> = (0..3).map(|i| p.token(i, me)).collect();
        assert_eq!(tokens[1].offset, 8192);
        assert_eq!(p.ptr(2) as usize - p.ptr(0) as usize, 8192);
        let q = HostPool::open(&ch, false, &tokens, 100).unwrap();
        assert_eq!(q.buffer_bytes(), 100);
        assert!(HostPool::open(&ch, false, &tokens, 101).is_err());
        let mut other = tokens.clone();
        other[0].handle[0] ^= 1;
        assert!(matches!(
            HostPool::open(&ch, false, &other, 100),
            Err(Error::Channel(super::super::ChannelError::Superseded(_)))
        ));
        assert!(matches!(
            HostPool::replaceable(&ch),
            Err(Error::Channel(
                super::super::ChannelError::AlreadyExists { .. }
            ))
        ));
        p.unlink();
        assert!(Segment::stat(&pool_name(&ch)).is_err());
    }
}
