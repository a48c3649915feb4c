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
pub const LAYOUT_VERSION: u32 = 1;
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
pub(crate) const W_META_PID: usize = 3;
pub(crate) const W_START: usize = 4;
pub(crate) const W_BOOT: usize = 5;
pub(crate) const W_NAME: usize = 7;
pub(crate) const W_TOKEN: usize = W_NAME + RECORD_NAME_MAX / 8;
pub(crate) const W_META: usize = W_TOKEN + TOKEN_MAX / 8;
pub(crate) const W_RESERVED: usize = W_META + METADATA_MAX / 8;

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
    pub creator_pid: AtomicU32,
    pub waiters: AtomicU32,
    pub creator_start_time: AtomicU64,
    pub _reserved1: [AtomicU64; 4],
}

/// One participant entry: who has the registry open.
#[repr(C)]
pub(crate) struct Participant {
    pub token: AtomicU64,
    pub pid: AtomicU32,
    pub _reserved0: AtomicU32,
    pub start_time: AtomicU64,
    pub boot_id: [AtomicU64; 2],
    pub _reserved1: [AtomicU64; 3],
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
const _: () = assert!(W_RESERVED + 7 == PAYLOAD_WORDS);
const _: () = assert!(16 + PAYLOAD_WORDS * 8 == SLOT_SIZE);
const _: () = assert!(SLOT_SIZE % 64 == 0 && PARTICIPANT_SIZE % 64 == 0 && HEADER_SIZE % 64 == 0);

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
    const _: () = assert!(offset_of!(Header, creator_pid) == 80);
    const _: () = assert!(offset_of!(Header, waiters) == 84);
    const _: () = assert!(offset_of!(Header, creator_start_time) == 88);
    const _: () = assert!(offset_of!(Header, _reserved1) == 96);

    const _: () = assert!(size_of::<Participant>() == PARTICIPANT_SIZE);
    const _: () = assert!(offset_of!(Participant, token) == 0);
    const _: () = assert!(offset_of!(Participant, pid) == 8);
    const _: () = assert!(offset_of!(Participant, start_time) == 16);
    const _: () = assert!(offset_of!(Participant, boot_id) == 24);
    const _: () = assert!(offset_of!(Participant, _reserved1) == 40);

    const _: () = assert!(size_of::<Slot>() == SLOT_SIZE);
    const _: () = assert!(offset_of!(Slot, writer) == 0);
    const _: () = assert!(offset_of!(Slot, seq) == 8);
    const _: () = assert!(offset_of!(Slot, payload) == 16);
    // Byte offsets of payload fields inside the slot, as documented.
    const _: () = assert!(16 + W_SEQ * 8 == 24);
    const _: () = assert!(16 + W_KIND_LENS * 8 == 32);
    const _: () = assert!(16 + W_META_PID * 8 == 40);
    const _: () = assert!(16 + W_START * 8 == 48);
    const _: () = assert!(16 + W_BOOT * 8 == 56);
    const _: () = assert!(16 + W_NAME * 8 == 72);
    const _: () = assert!(16 + W_TOKEN * 8 == 136);
    const _: () = assert!(16 + W_META * 8 == 392);
    const _: () = assert!(16 + W_RESERVED * 8 == 520);
}
