//! The registry's byte layout: header, participant entries and slots, all `#[repr(C)]` blocks of
//! atomics at fixed offsets. docs/registry-layout.md describes the same bytes for C and Python.
//!
//! Every field is an atomic, so no Rust reference to plain bytes of the segment is ever made: another
//! process may write any of them at any time. The layout is little-endian (checked below).

use crate::sync::{AtomicU32, AtomicU64};

/// `b"CUIPCREG"` read as a little-endian `u64`: the first eight bytes of every registry segment.
pub const MAGIC: u64 = u64::from_le_bytes(*b"CUIPCREG");
/// The layout version this build writes and reads. Bumped on any change an older reader would
/// misread; see docs/registry-layout.md for the rule.
pub const LAYOUT_VERSION: u32 = 3;
/// The value of `init_stamp` once the creator has written everything else (`b"INITDONE"`).
pub const INIT_STAMP: u64 = u64::from_le_bytes(*b"INITDONE");

/// Header size in bytes.
pub const HEADER_SIZE: usize = 128;
/// Participant entry size in bytes.
pub const PARTICIPANT_SIZE: usize = 64;
/// Slot size in bytes.
pub const SLOT_SIZE: usize = 576;
/// Payload words per slot (the seqlock-protected part).
pub const PAYLOAD_WORDS: usize = 70;

/// Longest record name, in bytes (UTF-8).
pub const RECORD_NAME_MAX: usize = 64;
/// Longest token, in bytes.
pub const TOKEN_MAX: usize = 256;
/// Longest user metadata, in bytes.
pub const METADATA_MAX: usize = 128;

/// Most slots a registry may have (keeps a corrupt header from asking for absurd sizes).
pub const MAX_SLOTS: u32 = 1 << 16;
/// Most participant entries a registry may have.
pub const MAX_PARTICIPANTS: u32 = 1 << 12;

/// Slot states (payload word 0, low 32 bits).
pub const STATE_FREE: u32 = 0;
/// A record is there.
pub const STATE_PUBLISHED: u32 = 1;

// Payload word indices.
pub(crate) const W_STATE: usize = 0;
pub(crate) const W_SEQ: usize = 1;
pub(crate) const W_KIND_LENS: usize = 2;
pub(crate) const W_META_LEN: usize = 3;
/// The owner's identity, as [`crate::identity::ProcessIdentity::to_words`] gives it (4 words).
pub(crate) const W_OWNER: usize = 4;
pub(crate) const W_NAME: usize = W_OWNER + 4;
pub(crate) const W_TOKEN: usize = W_NAME + RECORD_NAME_MAX / 8;
pub(crate) const W_META: usize = W_TOKEN + TOKEN_MAX / 8;
/// The owner's effective uid (low 32 bits; the high 32 are zero), whose liveness file alone counts
/// for the owner (layout version 3).
pub(crate) const W_OWNER_UID: usize = W_META + METADATA_MAX / 8;
pub(crate) const W_RESERVED: usize = W_OWNER_UID + 1;

/// Bits of a participant entry's `owner` word that hold the pid (pids are below 2^22 on Linux,
/// `PID_MAX_LIMIT`).
pub const OWNER_PID_BITS: u32 = 22;
/// Mask of the claim generation bits in an `owner` word (bits 22..32).
pub const OWNER_GEN_MASK: u64 = 0x3ff << OWNER_PID_BITS;

/// The segment header, at offset 0.
#[repr(C)]
pub(crate) struct Header {
    pub magic: AtomicU64,
    pub layout_version: AtomicU32,
    pub header_size: AtomicU32,
    pub init_stamp: AtomicU64,
    pub total_size: AtomicU64,
    pub slot_size: AtomicU32,
    pub slot_count: AtomicU32,
    pub participant_size: AtomicU32,
    pub participant_count: AtomicU32,
    pub record_name_max: AtomicU32,
    pub token_max: AtomicU32,
    pub metadata_max: AtomicU32,
    pub notify: AtomicU32,
    pub next_seq: AtomicU64,
    pub table_lock: AtomicU64,
    pub waiters: AtomicU32,
    /// The creator's effective uid (layout version 3).
    pub creator_uid: AtomicU32,
    pub generation: AtomicU64,
    pub creator: [AtomicU64; 4],
}

/// One participant entry: who has the registry open.
///
/// `owner` is the claim (0 = free; else pid | claim generation << 22 | pid namespace << 32, so a
/// claim that never completed still names its process); `lock_name` is the value this claim's
/// holder writes into lock words (claim generation << 32 | index + 1), valid while its generation
/// bits equal `owner`'s; `identity` is the holder's full identity and `uid` its effective uid,
/// both sealed by `lock_name`.
#[repr(C)]
pub(crate) struct Participant {
    pub owner: AtomicU64,
    pub lock_name: AtomicU64,
    pub claims: AtomicU64,
    pub identity: [AtomicU64; 4],
    pub uid: AtomicU32,
    pub _reserved: AtomicU32,
}

/// One slot: writer lock word, seqlock sequence, payload.
#[repr(C)]
pub(crate) struct Slot {
    pub writer: AtomicU64,
    pub seq: AtomicU64,
    pub payload: [AtomicU64; PAYLOAD_WORDS],
}

/// Offset of participant entry 0.
pub const PARTICIPANTS_OFFSET: usize = HEADER_SIZE;

/// Offset of slot 0 for `participants` entries.
pub fn slots_offset(participants: u32) -> usize {
    PARTICIPANTS_OFFSET + participants as usize * PARTICIPANT_SIZE
}

/// Total segment size for `participants` entries and `slots` slots.
pub fn total_size(participants: u32, slots: u32) -> usize {
    slots_offset(participants) + slots as usize * SLOT_SIZE
}

const _: () = assert!(
    cfg!(target_endian = "little"),
    "the registry layout is little-endian"
);
const _: () = assert!(W_RESERVED + 5 == PAYLOAD_WORDS);
const _: () = assert!(16 + PAYLOAD_WORDS * 8 == SLOT_SIZE);
const _: () = assert!(
    SLOT_SIZE.is_multiple_of(64)
        && PARTICIPANT_SIZE.is_multiple_of(64)
        && HEADER_SIZE.is_multiple_of(64)
);

// The sizes of the atomics differ under loom; the mapped layout is only used without it.
#[cfg(not(loom))]
mod asserts {
    use super::*;
    use std::mem::{align_of, offset_of, size_of};

    const _: () = assert!(size_of::<Header>() == HEADER_SIZE);
    const _: () = assert!(align_of::<Header>() == 8);
    const _: () = assert!(offset_of!(Header, magic) == 0);
    const _: () = assert!(offset_of!(Header, layout_version) == 8);
    const _: () = assert!(offset_of!(Header, header_size) == 12);
    const _: () = assert!(offset_of!(Header, init_stamp) == 16);
    const _: () = assert!(offset_of!(Header, total_size) == 24);
    const _: () = assert!(offset_of!(Header, slot_size) == 32);
    const _: () = assert!(offset_of!(Header, slot_count) == 36);
    const _: () = assert!(offset_of!(Header, participant_size) == 40);
    const _: () = assert!(offset_of!(Header, participant_count) == 44);
    const _: () = assert!(offset_of!(Header, record_name_max) == 48);
    const _: () = assert!(offset_of!(Header, token_max) == 52);
    const _: () = assert!(offset_of!(Header, metadata_max) == 56);
    const _: () = assert!(offset_of!(Header, notify) == 60);
    const _: () = assert!(offset_of!(Header, next_seq) == 64);
    const _: () = assert!(offset_of!(Header, table_lock) == 72);
    const _: () = assert!(offset_of!(Header, waiters) == 80);
    const _: () = assert!(offset_of!(Header, creator_uid) == 84);
    const _: () = assert!(offset_of!(Header, generation) == 88);
    const _: () = assert!(offset_of!(Header, creator) == 96);

    const _: () = assert!(size_of::<Participant>() == PARTICIPANT_SIZE);
    const _: () = assert!(offset_of!(Participant, owner) == 0);
    const _: () = assert!(offset_of!(Participant, lock_name) == 8);
    const _: () = assert!(offset_of!(Participant, claims) == 16);
    const _: () = assert!(offset_of!(Participant, identity) == 24);
    const _: () = assert!(offset_of!(Participant, uid) == 56);
    const _: () = assert!(offset_of!(Participant, _reserved) == 60);

    const _: () = assert!(size_of::<Slot>() == SLOT_SIZE);
    const _: () = assert!(offset_of!(Slot, writer) == 0);
    const _: () = assert!(offset_of!(Slot, seq) == 8);
    const _: () = assert!(offset_of!(Slot, payload) == 16);
    // Byte offsets of payload fields inside the slot, as documented.
    const _: () = assert!(16 + W_SEQ * 8 == 24);
    const _: () = assert!(16 + W_KIND_LENS * 8 == 32);
    const _: () = assert!(16 + W_META_LEN * 8 == 40);
    const _: () = assert!(16 + W_OWNER * 8 == 48);
    const _: () = assert!(16 + W_NAME * 8 == 80);
    const _: () = assert!(16 + W_TOKEN * 8 == 144);
    const _: () = assert!(16 + W_META * 8 == 400);
    const _: () = assert!(16 + W_OWNER_UID * 8 == 528);
    const _: () = assert!(16 + W_RESERVED * 8 == 536);
}
