//! The byte layout of a channel's control segment (layout version [`VERSION`]): every offset, size,
//! state value and wire code, in one place. docs/channel-layout.md describes the same bytes for C
//! and Python readers; `tests/channel_layout_doc.rs` checks its offset tables against [`FIELDS`].
//!
//! The segment, `/dev/shm/cuda-ipc.ch.NAME`: a `Header` at 0, then `buffers` × `BufferSlot`,
//! then `consumers` × `ConsumerSlot`, then, at the next 4096-byte boundary, the GPU words: the
//! ready page (one `u32` per buffer, and the gate words) and the release page (one `u32` per
//! consumer slot and buffer), which both ends register with the driver. All integers are little-endian and naturally aligned; every field is an
//! atomic (or, for the token areas, bytes copied through raw pointers), so no Rust reference to
//! plain bytes another process writes is ever made.
//!
//! Not part of the stable API: public (hidden) so that tests and tools can name the offsets.

use crate::sync::{AtomicU32, AtomicU64};
use crate::token::TOKEN_LEN;

/// Magic at offset 0: `b"CIPCCHAN"` read as a little-endian `u64`.
pub const MAGIC: u64 = u64::from_le_bytes(*b"CIPCCHAN");
/// Layout version; an opener refuses any other, naming both. Version 2 added the ready page;
/// version 3 the pid namespaces of producer and consumers and the creation generation; version 4
/// the sleeper counts beside the two futex words (a waker calls `FUTEX_WAKE` only when one is
/// nonzero, so a waiter of version 3, which does not count itself, would not be woken); version 5
/// the release page (release words written by consumers' streams in place of interprocess
/// events), the gate words, ring order, and fields reserved for monitoring and the remote lane
/// (publish times, per-consumer latency histograms, transport codes); version 6 the effective uids
/// of producer and consumers (a liveness file counts only when that uid or root owns it); version
/// 7 the producer's reservation of a pool of one buffer (no words changed: a consumer of version 6
/// clears its hold bit when a second hold of its own backs off from a reservation, which would let
/// the producer write under the first).
pub const VERSION: u32 = 7;
/// The header's `stamp` once the creator wrote everything else: `0x52454459` (ASCII `REDY`); 0 before.
pub const STAMP_READY: u32 = 0x5245_4459;
/// Size in bytes of the ready page: one `u32` ready word per buffer, then the gate words; on a
/// page of its own so that it can be registered with the driver (`cuMemHostRegister`); the page
/// starts at a multiple of this.
pub const READY_PAGE: usize = 4096;
/// Size in bytes of the release page, right after the ready page: one `u32` release word per
/// consumer slot and buffer ([`MAX_CONSUMERS`] × [`MAX_BUFFERS`] × 4 bytes).
pub const RELEASE_PAGE: usize = 4096;
/// Bytes of the GPU words at the end of the segment (the ready page, then the release page),
/// registered with the driver as one range by producer and consumers.
pub const GPU_WORDS: usize = READY_PAGE + RELEASE_PAGE;
/// Byte offset, in the ready page, of the gate's state word (`u32`, [`GateState`]): 0 while the
/// producer publishes; set, with [`GATE_END_OFFSET`], before the ready words of a closed or dead
/// producer's channel are raised, so that work posted ahead for a frame that never came can tell.
pub const GATE_STATE_OFFSET: usize = 64;
/// Byte offset, in the ready page, of the gate's end word (`u32`): the low 32 bits of the
/// sequence number of the last frame published when the gate closed. A frame `s` came when the
/// gate's state is 0 or `(int32)(s - end) <= 0`.
pub const GATE_END_OFFSET: usize = 68;
/// How far ahead of the last published frame the ready words are raised when the gate closes
/// (and so how far ahead of it a receive may be posted): 2^30 frames.
pub const GATE_HORIZON: u32 = 1 << 30;
/// Most buffers in a pool.
pub const MAX_BUFFERS: usize = 16;
/// Most consumers attached at once (one bit each in a 64-bit hold mask).
pub const MAX_CONSUMERS: usize = 64;
/// Bytes of user metadata per frame.
pub const META_BYTES: usize = 256;
/// Metadata words (`u64`) per buffer slot.
pub const META_WORDS: usize = META_BYTES / 8;

/// `BufferSlot::seq` of a buffer that never held a frame (or whose frame was given up).
pub const SEQ_EMPTY: u64 = 0;
/// `BufferSlot::seq` while the producer writes the buffer (or after it withdrew it at close).
pub const WRITING: u64 = u64::MAX;

/// The prefix of every channel's segment name: channel `NAME` lives in `/dev/shm/cuda-ipc.ch.NAME`.
pub const SEGMENT_PREFIX: &str = "cuda-ipc.ch.";

/// Header size in bytes.
pub const HEADER_SIZE: usize = 136;
/// Buffer slot size in bytes.
pub const BUFFER_SLOT_SIZE: usize = 32 + META_BYTES + 2 * TOKEN_LEN;
/// Consumer slot size in bytes.
pub const CONSUMER_SLOT_SIZE: usize = 512;
/// Buckets of a consumer's hand-off latency histogram: bucket 0 counts hand-offs under 1 µs,
/// bucket `k` (1..=30) those of [2^(k-1), 2^k) µs, bucket 31 those of 2^30 µs or more.
pub const LATENCY_BUCKETS: usize = 32;
/// Header flag: the channel hands buffers out in ring order (frame `s` in buffer `(s - 1) % B`),
/// so that receives can be posted ahead.
pub const FLAG_RING: u32 = 1;
/// Transport code of a channel or consumer whose frames are written on this host (0).
pub const TRANSPORT_LOCAL: u32 = 0;
/// Transport code of a channel a bridge fills from another host's channel (1).
pub const TRANSPORT_BRIDGED: u32 = 1;

/// Byte offsets of the header's fields (from the start of the segment).
pub mod header {
    /// `u64`: [`super::MAGIC`].
    pub const MAGIC: usize = 0;
    /// `u32`: [`super::VERSION`].
    pub const VERSION: usize = 8;
    /// `u32`: [`super::STAMP_READY`] once initialised, written last.
    pub const STAMP: usize = 12;
    /// `u32`: buffers in the pool, 1 to [`super::MAX_BUFFERS`].
    pub const BUFFERS: usize = 16;
    /// `u32`: consumer slots, 1 to [`super::MAX_CONSUMERS`].
    pub const CONSUMERS: usize = 20;
    /// `u64`: bytes per buffer of the pool.
    pub const BUFFER_BYTES: usize = 24;
    /// `u64`: bytes of the whole segment ([`super::segment_len`]).
    pub const SEGMENT_BYTES: usize = 32;
    /// `u32`: the producer's pid in its own pid namespace.
    pub const PRODUCER_PID: usize = 40;
    /// `u32`: [`super::ProducerState`].
    pub const PRODUCER_STATE: usize = 44;
    /// `u64`: the producer's start time, clock ticks since boot.
    pub const PRODUCER_START_TIME: usize = 48;
    /// 16 bytes (two `u64`): the producer's boot id.
    pub const PRODUCER_BOOT_ID: usize = 56;
    /// `u64`: sequence number of the latest published frame (0: none yet).
    pub const HEAD: usize = 72;
    /// `u32`: futex word, bumped on every publish and on close; consumers sleep on it.
    pub const PUBLISH_FUTEX: usize = 80;
    /// `u32`: futex word, bumped on every release, cursor move and detach; the producer sleeps on it.
    pub const RELEASE_FUTEX: usize = 84;
    /// `u32`: the index of the buffer that holds frame `head`, on `head`'s cache line, so that a
    /// consumer that wants the newest frame reads one buffer slot instead of every one (a hint:
    /// it checks that slot's `seq`).
    pub const HEAD_INDEX: usize = 88;
    /// `u32`: zero.
    pub const PAD2: usize = 92;
    /// `u64`: holds the producer released on behalf of dead consumers or at close.
    pub const FORCED_RELEASES: usize = 96;
    /// `u32`: the producer's pid namespace (inode number; 0 when unknown).
    pub const PRODUCER_PID_NS: usize = 104;
    /// `u32`: how the channel's frames arrive: [`super::TRANSPORT_LOCAL`] or
    /// [`super::TRANSPORT_BRIDGED`].
    pub const TRANSPORT: usize = 108;
    /// `u64`: creation generation, random and nonzero.
    pub const GENERATION: usize = 112;
    /// `u32`: waiters counted as (about to be) asleep on [`PUBLISH_FUTEX`]; a bump of the word
    /// calls `FUTEX_WAKE` only when this is nonzero.
    pub const PUBLISH_SLEEPERS: usize = 120;
    /// `u32`: waiters counted as (about to be) asleep on [`RELEASE_FUTEX`], as [`PUBLISH_SLEEPERS`].
    pub const RELEASE_SLEEPERS: usize = 124;
    /// `u32`: flags written at creation ([`super::FLAG_RING`]).
    pub const FLAGS: usize = 128;
    /// `u32`: the producer's effective uid.
    pub const PRODUCER_UID: usize = 132;
}

/// Byte offsets of a buffer slot's fields (from the start of the slot).
pub mod buffer {
    /// `u64`: sequence number of the frame in the buffer; [`super::SEQ_EMPTY`], or
    /// [`super::WRITING`] while the producer owns it.
    pub const SEQ: usize = 0;
    /// `u64`: consumers (bit = consumer slot index) holding its frame now.
    pub const HOLD_MASK: usize = 8;
    /// `u64`: consumers that held it since the producer last wrote it.
    pub const USED_MASK: usize = 16;
    /// `u32`: bytes of metadata of its frame, at most [`super::META_BYTES`].
    pub const META_LEN: usize = 24;
    /// `u32`: when its frame was published: `CLOCK_MONOTONIC` µs, low 32 bits (wraps every 71
    /// minutes; latencies are wrapping differences). On the slot's first cache line, with `seq`.
    pub const PUBLISH_US: usize = 28;
    /// [`super::META_BYTES`] bytes: the frame's metadata, as [`super::META_WORDS`] `u64` words.
    pub const META: usize = 32;
    /// [`crate::token::TOKEN_LEN`] bytes: the buffer's memory token.
    pub const MEMORY_TOKEN: usize = META + super::META_BYTES;
    /// The rest of the slot ([`crate::token::TOKEN_LEN`] bytes): zero.
    pub const RESERVED: usize = MEMORY_TOKEN + crate::token::TOKEN_LEN;
}

/// Byte offsets of a consumer slot's fields (from the start of the slot).
pub mod consumer {
    /// `u32`: [`super::ConsumerState`].
    pub const STATE: usize = 0;
    /// `u32`: [`super::Delivery`] wire code.
    pub const POLICY: usize = 4;
    /// `u64`: bumped each time the slot is claimed.
    pub const GENERATION: usize = 8;
    /// `u32`: the consumer's pid in its own pid namespace.
    pub const PID: usize = 16;
    /// `u32`: the consumer's pid namespace (inode number).
    pub const PID_NS: usize = 20;
    /// `u64`: the consumer's start time, clock ticks since boot.
    pub const START_TIME: usize = 24;
    /// 16 bytes (two `u64`): the consumer's boot id.
    pub const BOOT_ID: usize = 32;
    /// `u64`: last sequence number received (or skipped).
    pub const CURSOR: usize = 48;
    /// `u64`: frames received.
    pub const RECEIVED: usize = 56;
    /// `u64`: frames skipped.
    pub const DROPPED: usize = 64;
    /// `u32`: how this consumer's frames leave: [`super::TRANSPORT_LOCAL`], or
    /// [`super::TRANSPORT_BRIDGED`] for a bridge that sends them to another host.
    pub const TRANSPORT: usize = 72;
    /// `u32`: the consumer's effective uid.
    pub const UID: usize = 76;
    /// [`super::LATENCY_BUCKETS`] × `u64`: hand-offs by latency, publish to take (see
    /// [`super::LATENCY_BUCKETS`] for the buckets), written by the consumer alone.
    pub const LATENCY: usize = 80;
    /// `u64`: the sum of the latencies counted, µs.
    pub const LATENCY_SUM_US: usize = LATENCY + 8 * super::LATENCY_BUCKETS;
    /// The rest of the slot: zero.
    pub const RESERVED: usize = LATENCY_SUM_US + 8;
}

/// One field of the layout: where it is and how long, for the layout doc's test.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Field {
    /// The field's name, as in docs/channel-layout.md.
    pub name: &'static str,
    /// Byte offset from the start of its area (header, buffer slot, consumer slot).
    pub offset: usize,
    /// Size in bytes.
    pub size: usize,
}

const fn f(name: &'static str, offset: usize, size: usize) -> Field {
    Field { name, offset, size }
}

/// The header's fields, in order; they cover its [`HEADER_SIZE`] bytes without gaps.
pub const HEADER_FIELDS: &[Field] = &[
    f("magic", header::MAGIC, 8),
    f("version", header::VERSION, 4),
    f("stamp", header::STAMP, 4),
    f("buffers", header::BUFFERS, 4),
    f("consumers", header::CONSUMERS, 4),
    f("buffer_bytes", header::BUFFER_BYTES, 8),
    f("segment_bytes", header::SEGMENT_BYTES, 8),
    f("producer_pid", header::PRODUCER_PID, 4),
    f("producer_state", header::PRODUCER_STATE, 4),
    f("producer_start_time", header::PRODUCER_START_TIME, 8),
    f("producer_boot_id", header::PRODUCER_BOOT_ID, 16),
    f("head", header::HEAD, 8),
    f("publish_futex", header::PUBLISH_FUTEX, 4),
    f("release_futex", header::RELEASE_FUTEX, 4),
    f("head_index", header::HEAD_INDEX, 4),
    f("reserved", header::PAD2, 4),
    f("forced_releases", header::FORCED_RELEASES, 8),
    f("producer_pid_ns", header::PRODUCER_PID_NS, 4),
    f("transport", header::TRANSPORT, 4),
    f("generation", header::GENERATION, 8),
    f("publish_sleepers", header::PUBLISH_SLEEPERS, 4),
    f("release_sleepers", header::RELEASE_SLEEPERS, 4),
    f("flags", header::FLAGS, 4),
    f("producer_uid", header::PRODUCER_UID, 4),
];

/// A buffer slot's fields, in order; they cover its [`BUFFER_SLOT_SIZE`] bytes without gaps.
pub const BUFFER_FIELDS: &[Field] = &[
    f("seq", buffer::SEQ, 8),
    f("hold_mask", buffer::HOLD_MASK, 8),
    f("used_mask", buffer::USED_MASK, 8),
    f("meta_len", buffer::META_LEN, 4),
    f("publish_us", buffer::PUBLISH_US, 4),
    f("meta", buffer::META, META_BYTES),
    f("memory_token", buffer::MEMORY_TOKEN, TOKEN_LEN),
    f("reserved", buffer::RESERVED, TOKEN_LEN),
];

/// A consumer slot's fields, in order; they cover its [`CONSUMER_SLOT_SIZE`] bytes without gaps.
pub const CONSUMER_FIELDS: &[Field] = &[
    f("state", consumer::STATE, 4),
    f("policy", consumer::POLICY, 4),
    f("generation", consumer::GENERATION, 8),
    f("pid", consumer::PID, 4),
    f("pid_ns", consumer::PID_NS, 4),
    f("start_time", consumer::START_TIME, 8),
    f("boot_id", consumer::BOOT_ID, 16),
    f("cursor", consumer::CURSOR, 8),
    f("received", consumer::RECEIVED, 8),
    f("dropped", consumer::DROPPED, 8),
    f("transport", consumer::TRANSPORT, 4),
    f("uid", consumer::UID, 4),
    f("latency", consumer::LATENCY, 8 * LATENCY_BUCKETS),
    f("latency_sum_us", consumer::LATENCY_SUM_US, 8),
    f(
        "reserved",
        consumer::RESERVED,
        CONSUMER_SLOT_SIZE - consumer::RESERVED,
    ),
];

/// The areas of the layout and their fields: (name as in docs/channel-layout.md, size, fields).
pub const FIELDS: &[(&str, usize, &[Field])] = &[
    ("header", HEADER_SIZE, HEADER_FIELDS),
    ("buffer slot", BUFFER_SLOT_SIZE, BUFFER_FIELDS),
    ("consumer slot", CONSUMER_SLOT_SIZE, CONSUMER_FIELDS),
];

/// Offset of buffer slot 0.
pub const fn buffers_offset() -> usize {
    HEADER_SIZE
}

/// Offset of buffer slot `i`.
pub const fn buffer_offset(i: usize) -> usize {
    buffers_offset() + i * BUFFER_SLOT_SIZE
}

/// Offset of consumer slot `c` in a segment of `buffers` buffers.
pub const fn consumer_offset(buffers: usize, c: usize) -> usize {
    buffer_offset(buffers) + c * CONSUMER_SLOT_SIZE
}

/// Offset of the ready page (the start of the GPU words): the end of the consumer slots, rounded
/// up to [`READY_PAGE`].
pub const fn ready_offset(buffers: usize, consumers: usize) -> usize {
    consumer_offset(buffers, consumers).next_multiple_of(READY_PAGE)
}

/// Offset of the release word of consumer slot `c` and buffer `i` from the start of the GPU
/// words (the ready page): in the release page, at 4 × (16 `c` + `i`).
pub const fn release_word_offset(c: usize, i: usize) -> usize {
    READY_PAGE + (c * MAX_BUFFERS + i) * READY_WORD_SIZE
}

/// Size in bytes of one ready word (a `u32`); buffer `i`'s is at [`READY_WORD_SIZE`] × `i` in
/// the ready page.
pub const READY_WORD_SIZE: usize = 4;

/// Offset of buffer `i`'s ready word from the start of the ready page.
pub const fn ready_word_offset(i: usize) -> usize {
    i * READY_WORD_SIZE
}

/// Bytes of the whole segment (the header's `segment_bytes`): the release page's end.
pub const fn segment_len(buffers: usize, consumers: usize) -> usize {
    ready_offset(buffers, consumers) + GPU_WORDS
}

/// The latency bucket of a hand-off that took `us` µs (see [`LATENCY_BUCKETS`]).
#[inline]
pub const fn latency_bucket(us: u64) -> usize {
    if us == 0 {
        0
    } else {
        let k = 64 - us.leading_zeros() as usize;
        if k < LATENCY_BUCKETS - 1 {
            k
        } else {
            LATENCY_BUCKETS - 1
        }
    }
}

/// The gate's state word (in the ready page, at [`GATE_STATE_OFFSET`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum GateState {
    /// The producer publishes (code 0).
    Open,
    /// The producer closed the channel (code 1).
    Closed,
    /// The producer died; a consumer closed the gate for it (code 2).
    ProducerGone,
}

impl GateState {
    /// The state's code.
    pub const fn to_wire(self) -> u32 {
        match self {
            GateState::Open => 0,
            GateState::Closed => 1,
            GateState::ProducerGone => 2,
        }
    }

    /// The state stored as `code`.
    ///
    /// # Errors
    /// [`UnknownCode`] for any other code.
    pub const fn from_wire(code: u32) -> Result<Self, UnknownCode> {
        match code {
            0 => Ok(GateState::Open),
            1 => Ok(GateState::Closed),
            2 => Ok(GateState::ProducerGone),
            _ => Err(UnknownCode {
                field: "gate state",
                code,
            }),
        }
    }
}

/// A stored code that this build does not know: the field it was read from and its value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnknownCode {
    /// The field (`"policy"`, `"consumer state"`, `"producer state"`).
    pub field: &'static str,
    /// The value found.
    pub code: u32,
}

impl std::fmt::Display for UnknownCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "unknown {} code {}", self.field, self.code)
    }
}

impl std::error::Error for UnknownCode {}

/// Delivery policy of one consumer.
///
/// With the `serde` feature it serialises as `"every-frame"` or `"latest-only"`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize),
    serde(rename_all = "kebab-case")
)]
#[non_exhaustive]
pub enum Delivery {
    /// Every frame, in order; the producer waits (back-pressure) until this consumer received it.
    #[default]
    EveryFrame,
    /// Only the newest frame; older unreceived frames are skipped and counted as dropped.
    LatestOnly,
}

impl Delivery {
    /// The policy's code in a consumer slot's `policy` word: 0 every frame, 1 latest only.
    pub const fn to_wire(self) -> u32 {
        match self {
            Delivery::EveryFrame => 0,
            Delivery::LatestOnly => 1,
        }
    }

    /// The policy stored as `code`.
    ///
    /// # Errors
    /// [`UnknownCode`] for a code no policy has (a corrupted slot, or a newer writer).
    pub const fn from_wire(code: u32) -> Result<Self, UnknownCode> {
        match code {
            0 => Ok(Delivery::EveryFrame),
            1 => Ok(Delivery::LatestOnly),
            _ => Err(UnknownCode {
                field: "policy",
                code,
            }),
        }
    }
}

/// A consumer slot's `state` word.
///
/// With the `serde` feature it serialises as what the slot's consumer is: `"free"`,
/// `"attaching"` (claiming) or `"attached"` (active).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub enum ConsumerState {
    /// Nobody has the slot (code 0).
    #[cfg_attr(feature = "serde", serde(rename = "free"))]
    Free,
    /// A consumer took it and is writing its fields (code 1).
    #[cfg_attr(feature = "serde", serde(rename = "attaching"))]
    Claiming,
    /// Attached: every field written (code 2).
    #[cfg_attr(feature = "serde", serde(rename = "attached"))]
    Active,
    /// Being freed, by the consumer detaching or by a reclaimer of a dead consumer's slot (code 3).
    #[cfg_attr(feature = "serde", serde(rename = "leaving"))]
    Leaving,
}

impl ConsumerState {
    /// The state's code.
    pub const fn to_wire(self) -> u32 {
        match self {
            ConsumerState::Free => 0,
            ConsumerState::Claiming => 1,
            ConsumerState::Active => 2,
            ConsumerState::Leaving => 3,
        }
    }

    /// The state stored as `code`.
    ///
    /// # Errors
    /// [`UnknownCode`] for any other code.
    pub const fn from_wire(code: u32) -> Result<Self, UnknownCode> {
        match code {
            0 => Ok(ConsumerState::Free),
            1 => Ok(ConsumerState::Claiming),
            2 => Ok(ConsumerState::Active),
            3 => Ok(ConsumerState::Leaving),
            _ => Err(UnknownCode {
                field: "consumer state",
                code,
            }),
        }
    }
}

/// The header's `producer_state` word.
///
/// With the `serde` feature it serialises as `"open"` or `"closed"`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize),
    serde(rename_all = "lowercase")
)]
#[non_exhaustive]
pub enum ProducerState {
    /// Publishing (code 0).
    Open,
    /// The producer closed the channel (code 1).
    Closed,
}

impl ProducerState {
    /// The state's code.
    pub const fn to_wire(self) -> u32 {
        match self {
            ProducerState::Open => 0,
            ProducerState::Closed => 1,
        }
    }

    /// The state stored as `code`.
    ///
    /// # Errors
    /// [`UnknownCode`] for any other code.
    pub const fn from_wire(code: u32) -> Result<Self, UnknownCode> {
        match code {
            0 => Ok(ProducerState::Open),
            1 => Ok(ProducerState::Closed),
            _ => Err(UnknownCode {
                field: "producer state",
                code,
            }),
        }
    }
}

/// Consumer slot state codes, for the protocol's loads and compare-exchanges.
pub(crate) const FREE: u32 = ConsumerState::Free.to_wire();
pub(crate) const CLAIMING: u32 = ConsumerState::Claiming.to_wire();
pub(crate) const ACTIVE: u32 = ConsumerState::Active.to_wire();
pub(crate) const LEAVING: u32 = ConsumerState::Leaving.to_wire();
/// The producer state code of a closed channel.
pub(crate) const CLOSED: u32 = ProducerState::Closed.to_wire();
/// Policy codes.
pub(crate) const EVERY_FRAME: u32 = Delivery::EveryFrame.to_wire();
pub(crate) const LATEST_ONLY: u32 = Delivery::LatestOnly.to_wire();

/// The segment header, at offset 0 (see [`header`] for each field's offset and meaning).
#[repr(C)]
pub(crate) struct Header {
    pub(crate) magic: AtomicU64,
    pub(crate) version: AtomicU32,
    /// Written last at creation (Release); openers Acquire-load it before reading anything else.
    pub(crate) stamp: AtomicU32,
    pub(crate) buffers: AtomicU32,
    pub(crate) consumers: AtomicU32,
    pub(crate) buffer_bytes: AtomicU64,
    pub(crate) segment_bytes: AtomicU64,
    pub(crate) producer_pid: AtomicU32,
    pub(crate) producer_state: AtomicU32,
    pub(crate) producer_start_time: AtomicU64,
    pub(crate) producer_boot_id: [AtomicU64; 2],
    /// Sequence number of the latest published frame (0: none yet).
    pub(crate) head: AtomicU64,
    /// Bumped on every publish and on close; consumers sleep on it.
    pub(crate) publish_futex: AtomicU32,
    /// Bumped on every release, cursor move and detach; the producer sleeps on it.
    pub(crate) release_futex: AtomicU32,
    /// The buffer index of frame `head` (a hint).
    pub(crate) head_index: AtomicU32,
    pub(crate) _pad2: AtomicU32,
    pub(crate) forced_releases: AtomicU64,
    /// The producer's pid namespace (inode number), so its pid is read in the right namespace.
    pub(crate) producer_pid_ns: AtomicU32,
    /// [`TRANSPORT_LOCAL`] or [`TRANSPORT_BRIDGED`].
    pub(crate) transport: AtomicU32,
    /// Random, nonzero, written once at creation: tells a segment recreated under the same name
    /// apart from the one a process mapped.
    pub(crate) generation: AtomicU64,
    /// Waiters counted as asleep on `publish_futex` (consumers); see `wait::WakeWord`.
    pub(crate) publish_sleepers: AtomicU32,
    /// Waiters counted as asleep on `release_futex` (the producer); see `wait::WakeWord`.
    pub(crate) release_sleepers: AtomicU32,
    /// [`FLAG_RING`]; written at creation.
    pub(crate) flags: AtomicU32,
    /// The producer's effective uid; written with its identity.
    pub(crate) producer_uid: AtomicU32,
}

/// One buffer of the pool (see [`buffer`]).
#[repr(C)]
pub(crate) struct BufferSlot {
    /// Sequence number of the frame in the buffer; 0 empty; [`WRITING`] while the producer owns it.
    pub(crate) seq: AtomicU64,
    /// Consumers (bit = slot index) holding the frame now.
    pub(crate) hold_mask: AtomicU64,
    /// Consumers that held the buffer since the producer last wrote it: the producer's next write
    /// waits on their release events.
    pub(crate) used_mask: AtomicU64,
    pub(crate) meta_len: AtomicU32,
    /// `CLOCK_MONOTONIC` µs (low 32 bits) of its frame's publish.
    pub(crate) publish_us: AtomicU32,
    pub(crate) meta: [AtomicU64; META_WORDS],
    /// Token of the buffer memory (immutable after creation).
    pub(crate) tokens: [u8; TOKEN_LEN],
    pub(crate) _reserved: [u8; TOKEN_LEN],
}

/// One consumer slot (see [`consumer`]).
#[repr(C)]
pub(crate) struct ConsumerSlot {
    pub(crate) state: AtomicU32,
    pub(crate) policy: AtomicU32,
    /// Bumped each time the slot is claimed, so the producer can tell a reused slot apart.
    pub(crate) generation: AtomicU64,
    pub(crate) pid: AtomicU32,
    /// The consumer's pid namespace (inode number).
    pub(crate) pid_ns: AtomicU32,
    pub(crate) start_time: AtomicU64,
    pub(crate) boot_id: [AtomicU64; 2],
    /// Last sequence number received (or skipped).
    pub(crate) cursor: AtomicU64,
    pub(crate) received: AtomicU64,
    pub(crate) dropped: AtomicU64,
    /// [`TRANSPORT_LOCAL`] or [`TRANSPORT_BRIDGED`].
    pub(crate) transport: AtomicU32,
    /// The consumer's effective uid; written with its identity.
    pub(crate) uid: AtomicU32,
    /// Hand-offs by latency bucket ([`latency_bucket`]); only the consumer writes them.
    pub(crate) latency: [AtomicU64; LATENCY_BUCKETS],
    /// Sum of the latencies counted, µs.
    pub(crate) latency_sum_us: AtomicU64,
    pub(crate) _reserved: [u8; CONSUMER_SLOT_SIZE - consumer::RESERVED],
}

/// Whether `fields` cover `size` bytes in order, each starting where the one before ended.
const fn contiguous(fields: &[Field], size: usize) -> bool {
    let mut at = 0;
    let mut i = 0;
    while i < fields.len() {
        if fields[i].offset != at {
            return false;
        }
        at += fields[i].size;
        i += 1;
    }
    at == size
}

const _: () = assert!(
    cfg!(target_endian = "little"),
    "the channel layout is little-endian"
);
const _: () = assert!(contiguous(HEADER_FIELDS, HEADER_SIZE));
const _: () = assert!(contiguous(BUFFER_FIELDS, BUFFER_SLOT_SIZE));
const _: () = assert!(contiguous(CONSUMER_FIELDS, CONSUMER_SLOT_SIZE));
const _: () = assert!(HEADER_SIZE.is_multiple_of(8) && BUFFER_SLOT_SIZE.is_multiple_of(8));
const _: () = assert!(CONSUMER_SLOT_SIZE.is_multiple_of(8));
const _: () = assert!(MAX_CONSUMERS <= 64 && ready_word_offset(MAX_BUFFERS) <= GATE_STATE_OFFSET);
const _: () =
    assert!(GATE_END_OFFSET == GATE_STATE_OFFSET + 4 && GATE_END_OFFSET + 4 <= READY_PAGE);
const _: () = assert!(release_word_offset(MAX_CONSUMERS - 1, MAX_BUFFERS - 1) + 4 == GPU_WORDS);
const _: () = assert!(consumer::RESERVED <= CONSUMER_SLOT_SIZE);
const _: () = assert!(header::STAMP == 12 && header::MAGIC == 0 && header::VERSION == 8);
const _: () = assert!(HEADER_SIZE == 136 && BUFFER_SLOT_SIZE == 576 && CONSUMER_SLOT_SIZE == 512);
// Each sleeper count is a naturally aligned u32 (a single atomic word for every reader).
const _: () = assert!(header::PUBLISH_SLEEPERS.is_multiple_of(4));
const _: () = assert!(header::RELEASE_SLEEPERS == header::PUBLISH_SLEEPERS + 4);

// The sizes of the atomics differ under loom; the mapped layout is only used without it.
#[cfg(not(loom))]
mod asserts {
    use super::*;
    use std::mem::{align_of, offset_of, size_of};

    const _: () = assert!(size_of::<Header>() == HEADER_SIZE);
    const _: () = assert!(align_of::<Header>() == 8);
    const _: () = assert!(offset_of!(Header, magic) == header::MAGIC);
    const _: () = assert!(offset_of!(Header, version) == header::VERSION);
    const _: () = assert!(offset_of!(Header, stamp) == header::STAMP);
    const _: () = assert!(offset_of!(Header, buffers) == header::BUFFERS);
    const _: () = assert!(offset_of!(Header, consumers) == header::CONSUMERS);
    const _: () = assert!(offset_of!(Header, buffer_bytes) == header::BUFFER_BYTES);
    const _: () = assert!(offset_of!(Header, segment_bytes) == header::SEGMENT_BYTES);
    const _: () = assert!(offset_of!(Header, producer_pid) == header::PRODUCER_PID);
    const _: () = assert!(offset_of!(Header, producer_state) == header::PRODUCER_STATE);
    const _: () = assert!(offset_of!(Header, producer_start_time) == header::PRODUCER_START_TIME);
    const _: () = assert!(offset_of!(Header, producer_boot_id) == header::PRODUCER_BOOT_ID);
    const _: () = assert!(offset_of!(Header, head) == header::HEAD);
    const _: () = assert!(offset_of!(Header, publish_futex) == header::PUBLISH_FUTEX);
    const _: () = assert!(offset_of!(Header, release_futex) == header::RELEASE_FUTEX);
    const _: () = assert!(offset_of!(Header, head_index) == header::HEAD_INDEX);
    const _: () = assert!(
        header::HEAD_INDEX / 64 == header::HEAD / 64,
        "one cache line"
    );
    const _: () = assert!(offset_of!(Header, forced_releases) == header::FORCED_RELEASES);
    const _: () = assert!(offset_of!(Header, producer_pid_ns) == header::PRODUCER_PID_NS);
    const _: () = assert!(offset_of!(Header, transport) == header::TRANSPORT);
    const _: () = assert!(offset_of!(Header, generation) == header::GENERATION);
    const _: () = assert!(offset_of!(Header, publish_sleepers) == header::PUBLISH_SLEEPERS);
    const _: () = assert!(offset_of!(Header, release_sleepers) == header::RELEASE_SLEEPERS);
    const _: () = assert!(offset_of!(Header, flags) == header::FLAGS);
    const _: () = assert!(offset_of!(Header, producer_uid) == header::PRODUCER_UID);

    const _: () = assert!(size_of::<BufferSlot>() == BUFFER_SLOT_SIZE);
    const _: () = assert!(align_of::<BufferSlot>() == 8);
    const _: () = assert!(offset_of!(BufferSlot, seq) == buffer::SEQ);
    const _: () = assert!(offset_of!(BufferSlot, hold_mask) == buffer::HOLD_MASK);
    const _: () = assert!(offset_of!(BufferSlot, used_mask) == buffer::USED_MASK);
    const _: () = assert!(offset_of!(BufferSlot, meta_len) == buffer::META_LEN);
    const _: () = assert!(offset_of!(BufferSlot, publish_us) == buffer::PUBLISH_US);
    const _: () = assert!(offset_of!(BufferSlot, meta) == buffer::META);
    const _: () = assert!(offset_of!(BufferSlot, tokens) == buffer::MEMORY_TOKEN);
    const _: () = assert!(offset_of!(BufferSlot, _reserved) == buffer::RESERVED);

    const _: () = assert!(size_of::<ConsumerSlot>() == CONSUMER_SLOT_SIZE);
    const _: () = assert!(align_of::<ConsumerSlot>() == 8);
    const _: () = assert!(offset_of!(ConsumerSlot, state) == consumer::STATE);
    const _: () = assert!(offset_of!(ConsumerSlot, policy) == consumer::POLICY);
    const _: () = assert!(offset_of!(ConsumerSlot, generation) == consumer::GENERATION);
    const _: () = assert!(offset_of!(ConsumerSlot, pid) == consumer::PID);
    const _: () = assert!(offset_of!(ConsumerSlot, pid_ns) == consumer::PID_NS);
    const _: () = assert!(offset_of!(ConsumerSlot, start_time) == consumer::START_TIME);
    const _: () = assert!(offset_of!(ConsumerSlot, boot_id) == consumer::BOOT_ID);
    const _: () = assert!(offset_of!(ConsumerSlot, cursor) == consumer::CURSOR);
    const _: () = assert!(offset_of!(ConsumerSlot, received) == consumer::RECEIVED);
    const _: () = assert!(offset_of!(ConsumerSlot, dropped) == consumer::DROPPED);
    const _: () = assert!(offset_of!(ConsumerSlot, transport) == consumer::TRANSPORT);
    const _: () = assert!(offset_of!(ConsumerSlot, uid) == consumer::UID);
    const _: () = assert!(offset_of!(ConsumerSlot, latency) == consumer::LATENCY);
    const _: () = assert!(offset_of!(ConsumerSlot, latency_sum_us) == consumer::LATENCY_SUM_US);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::channel::Delivery;

    #[test]
    fn wire_codes_round_trip_and_unknown_codes_are_errors() {
        for d in [Delivery::EveryFrame, Delivery::LatestOnly] {
            assert_eq!(Delivery::from_wire(d.to_wire()), Ok(d));
        }
        for s in [
            ConsumerState::Free,
            ConsumerState::Claiming,
            ConsumerState::Active,
            ConsumerState::Leaving,
        ] {
            assert_eq!(ConsumerState::from_wire(s.to_wire()), Ok(s));
        }
        for s in [ProducerState::Open, ProducerState::Closed] {
            assert_eq!(ProducerState::from_wire(s.to_wire()), Ok(s));
        }
        let e = Delivery::from_wire(7).unwrap_err();
        assert_eq!((e.field, e.code), ("policy", 7));
        assert_eq!(e.to_string(), "unknown policy code 7");
        assert!(ConsumerState::from_wire(4).is_err());
        assert!(ProducerState::from_wire(u32::MAX).is_err());
    }

    #[test]
    fn the_segment_is_laid_out_as_documented() {
        assert_eq!(buffer_offset(0), 136);
        assert_eq!(consumer_offset(2, 0), 136 + 2 * 576);
        assert_eq!(ready_offset(1, 1), 4096);
        assert_eq!(segment_len(16, 64), ready_offset(16, 64) + 8192);
        assert_eq!(release_word_offset(0, 0), 4096);
        assert_eq!(release_word_offset(1, 2), 4096 + 4 * 18);
        assert_eq!(ready_offset(16, 64) % READY_PAGE, 0);
        assert_eq!(STAMP_READY.to_le_bytes(), *b"YDER");
    }

    #[test]
    fn latency_buckets_are_log2_microseconds() {
        assert_eq!(latency_bucket(0), 0);
        assert_eq!(latency_bucket(1), 1);
        assert_eq!(latency_bucket(2), 2);
        assert_eq!(latency_bucket(3), 2);
        assert_eq!(latency_bucket(4), 3);
        assert_eq!(latency_bucket(1023), 10);
        assert_eq!(latency_bucket(1 << 29), 30);
        assert_eq!(latency_bucket((1 << 30) - 1), 30);
        assert_eq!(latency_bucket(1 << 30), 31);
        assert_eq!(latency_bucket(u64::MAX), 31);
        for g in [GateState::Open, GateState::Closed, GateState::ProducerGone] {
            assert_eq!(GateState::from_wire(g.to_wire()), Ok(g));
        }
        assert!(GateState::from_wire(3).is_err());
    }
}
