//! The byte layout of a quota ledger segment (little-endian, `#[repr(C)]`, atomics only), version 2:
//!
//! | offset | size | field |
//! | --- | --- | --- |
//! | 0 | 8 | magic `CIPCQUOT` |
//! | 8 | 4 | layout version (2) |
//! | 12 | 4 | init stamp (written last, `Release`) |
//! | 16 | 8 | creation generation (random, nonzero) |
//! | 24 | 32 | creator identity (the four words of `ProcessIdentity::store_words`) |
//! | 56 | 8 | budget in bytes (`u64::MAX`: unlimited) |
//! | 64 | 8 | bytes in use (a copy of the entries' sum, rewritten under the lock) |
//! | 72 | 8 | changes (bumped by every change under the lock) |
//! | 80 | 4 | entry count ([`ENTRIES`]) |
//! | 84 | 4 | scope: 0 user, 1 group |
//! | 88 | 16 | device UUID (all zeros: host memory) |
//! | 104 | 4 | scope id: the uid or the gid |
//! | 108 | 4 | reserved (0) |
//!
//! Entries start at [`ENTRIES_AT`] (the second page), [`ENTRY_LEN`] bytes each:
//!
//! | offset | size | field |
//! | --- | --- | --- |
//! | 0 | 8 | state (0 free, 1 writing, 2 held) |
//! | 8 | 32 | the holder's identity words |
//! | 40 | 8 | bytes |
//! | 48 | 8 | a random reservation id |
//! | 56 | 8 | the holder's uid |
//! | 64 | 8 | the inode of the `/dev/shm` segment holding the bytes (0: none recorded, as for GPU memory) |
//! | 72 | 8 | a hash of that segment's name (the first 8 bytes of its SHA-256, little-endian, never 0) |
//! | 80 | 48 | reserved (0) |
//!
//! Version 2 added the segment (version 1 entries were 64 bytes): a dead holder's host memory stays
//! in `/dev/shm` until its segment is removed, so its bytes stay counted until then.
//! Every field is written only under the ledger lock (the `F_OFD_SETLK` lock on byte
//! [`LOCK_OFFSET`] of the file).

use crate::shm::versioned::{StampWord, VersionedHeader};
use crate::sync::{AtomicU32, AtomicU64};

/// A budget of `UNLIMITED` bytes: no limit (the ledger still counts what is held); the budget
/// word's value for it.
pub const UNLIMITED: u64 = u64::MAX;

/// Magic at offset 0: `CIPCQUOT`.
pub(crate) const MAGIC: u64 = u64::from_le_bytes(*b"CIPCQUOT");
/// Layout version this build writes and reads.
pub(crate) const VERSION: u32 = 2;
/// The init stamp.
pub(crate) const STAMP: u32 = 0x5155_4f54;
/// Entries in a ledger: at most this many live reservations per device and scope.
pub(crate) const ENTRIES: u32 = 256;
/// Offset of the first entry.
pub(crate) const ENTRIES_AT: usize = 4096;
/// Bytes per entry.
pub(crate) const ENTRY_LEN: usize = 128;
/// Bytes of a ledger segment.
pub(crate) const LEDGER_LEN: usize = ENTRIES_AT + ENTRIES as usize * ENTRY_LEN;
/// The byte of the segment file the ledger lock covers (far past the end of the file, apart from
/// the replacers' lock of `shm`, which sits at `1 << 62`).
pub(crate) const LOCK_OFFSET: i64 = 1 << 61;
/// An entry's state: free.
pub(crate) const FREE: u64 = 0;
/// An entry's state: being written under the lock; left so only by a locker that died.
pub(crate) const WRITING: u64 = 1;
/// An entry's state: a reservation.
pub(crate) const HELD: u64 = 2;
/// Scope word: a user's ledger.
pub(crate) const SCOPE_USER: u32 = 0;
/// Scope word: a group's ledger.
pub(crate) const SCOPE_GROUP: u32 = 1;

/// The ledger's header (first page).
#[repr(C)]
pub(crate) struct Header {
    pub(crate) magic: AtomicU64,
    pub(crate) version: AtomicU32,
    pub(crate) stamp: AtomicU32,
    pub(crate) generation: AtomicU64,
    pub(crate) creator: [AtomicU64; 4],
    pub(crate) budget: AtomicU64,
    pub(crate) used: AtomicU64,
    pub(crate) changes: AtomicU64,
    pub(crate) entries: AtomicU32,
    pub(crate) scope: AtomicU32,
    pub(crate) device: [AtomicU64; 2],
    pub(crate) scope_id: AtomicU32,
    pub(crate) _reserved: AtomicU32,
}

/// One reservation entry.
#[repr(C)]
pub(crate) struct Entry {
    pub(crate) state: AtomicU64,
    pub(crate) identity: [AtomicU64; 4],
    pub(crate) bytes: AtomicU64,
    pub(crate) id: AtomicU64,
    pub(crate) uid: AtomicU64,
    /// The inode of the `/dev/shm` segment that holds the reserved bytes (host memory); 0 when
    /// none is recorded.
    pub(crate) memory_inode: AtomicU64,
    /// [`super::segment::name_hash`] of that segment's name; 0 when none is recorded.
    pub(crate) memory_name: AtomicU64,
    pub(crate) _reserved: [AtomicU64; 6],
}

#[cfg(not(loom))] // loom atomics have other sizes; the mapped layout is only used without it
const _: () = {
    assert!(size_of::<Header>() == 112);
    assert!(std::mem::offset_of!(Header, budget) == 56);
    assert!(std::mem::offset_of!(Header, used) == 64);
    assert!(std::mem::offset_of!(Header, entries) == 80);
    assert!(std::mem::offset_of!(Header, device) == 88);
    assert!(std::mem::offset_of!(Header, scope_id) == 104);
    assert!(size_of::<Entry>() == ENTRY_LEN);
    assert!(std::mem::offset_of!(Entry, bytes) == 40);
    assert!(std::mem::offset_of!(Entry, memory_inode) == 64);
    assert!(std::mem::offset_of!(Entry, memory_name) == 72);
};

// SAFETY: (1) `Header` is `#[repr(C)]` and all atomics; (2) its alignment is 8, which divides
// 4096; (3) it is 112 bytes, within HEADER_LEN (the header page; every opener checks it).
unsafe impl VersionedHeader for Header {
    const MAGIC: u64 = MAGIC;
    const VERSION: u32 = VERSION;
    // The header page: a ledger of another layout version (whose entries differ in size) is
    // refused by its version, not its length; `QuotaLedger::open_named` then refuses a ledger of
    // this version cut short of its entries (TooSmall) before it reads one.
    const HEADER_LEN: usize = ENTRIES_AT;
    // A creator stores the stamp once, over 0: any other word is a garbled ledger, refused at
    // once (not awaited for 1 s by every open, nor judged an unfinished creation `gc` may remove).
    const STRICT_STAMP: bool = true;

    fn magic(&self) -> &AtomicU64 {
        &self.magic
    }
    fn version(&self) -> &AtomicU32 {
        &self.version
    }
    fn stamp(&self) -> StampWord<'_> {
        StampWord::U32(&self.stamp, STAMP)
    }
    fn generation(&self) -> &AtomicU64 {
        &self.generation
    }
}
