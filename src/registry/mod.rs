//! The registry: a named POSIX shared-memory segment of fixed-layout slots carrying published handles,
//! sequence numbers and the liveness of every participant. It stores handles as bytes and never calls
//! CUDA.
//!
//! Owns: [`Registry`] (create / open / publish / get / wait / list / remove / reclaim), [`Record`],
//! [`RegistryError`] and the byte layout in [`layout`](crate::raw::registry_layout) (described for C and Python readers in
//! docs/registry-layout.md). Built on [`crate::raw::shm`]; must not touch `ipc`, `driver` or tokens'
//! contents.
//!
//! Errors: [`RegistryError`] for what the registry's own layout, records and participant table
//! report; what its segment reports (missing, taken, another user's, sparse, too small, a slot
//! that stays mid-write) is passed on unchanged as [`Error::Shm`], one pattern whichever layer
//! opened the segment.
//!
//! How it stays sound when peers misbehave or die:
//! - each record sits in one slot under a seqlock whose payload words are atomics: readers copy and
//!   validate, so a torn record is never returned;
//! - a slot's writer lock word holds the writer's lock name, which leads to its participant entry
//!   and full identity (pid, start time, boot id, pid namespace); a lock whose holder is dead by
//!   [`ProcessIdentity::liveness`] is taken over, and a write it left open is dropped (slot freed)
//!   without the half-written record ever reading as stable;
//! - whether a process is dead is only ever decided by [`ProcessIdentity::liveness`], which is
//!   right across pid namespaces (containers sharing `/dev/shm`); `Unknown` counts as alive;
//! - sequence numbers come from one registry-wide counter, taken under the slot lock, so the
//!   numbers of a name only increase, across removals and recoveries too;
//! - waiters sleep on one shared futex word that every change bumps, always with a timeout.
//!
//! Files: `segment` (create, open, attach, and the replacement of a stale segment: the segment
//! protocol of `shm::versioned` for this layout), `participant` (participant entries: claim,
//! liveness of a lock's holder, reclaim), `records` (publish, get, wait, list, remove, and the
//! slot locks under them), `reclaim` ([`Registry::reclaim_dead`]), `slot` (a slot's lock word and
//! seqlock), [`layout`](crate::raw::registry_layout), [`inspect`]. This file holds the types and what every part uses.

pub(crate) mod error;
pub mod inspect;
pub(crate) mod layout;
mod participant;
mod reclaim;
mod records;
mod remove;
mod segment;
pub(crate) mod slot;

pub use error::RegistryError;
pub use reclaim::{ReclaimReport, Reclaimed};
pub use remove::remove_abandoned;

use crate::error::{Error, Result};
use crate::identity::ForkEpoch;
use crate::identity::{Liveness, ProcessIdentity};
use crate::shm::Segment;
use crate::sync::Ordering;
use layout::*;
use slot::SlotView;
use std::time::{Duration, Instant};

/// How often a blocking call looks whether the registry's name still stands for its segment.
const SUPERSEDED_CHECK: Duration = Duration::from_millis(250);

/// How a [`Registry`] is created or opened.
///
/// # Examples
/// ```
/// use cuda_ipc::registry::RegistryOptions;
/// use std::time::Duration;
/// let opts = RegistryOptions::new().capacity(16).init_timeout(Duration::from_millis(200));
/// assert_eq!(opts.slots(), 16);
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct RegistryOptions {
    slots: u32,
    participants: u32,
    group_access: bool,
    init_timeout: Duration,
    lock_timeout: Duration,
}

impl Default for RegistryOptions {
    fn default() -> Self {
        Self {
            slots: 64,
            participants: 64,
            group_access: false,
            init_timeout: Duration::from_secs(1),
            lock_timeout: Duration::from_secs(2),
        }
    }
}

impl RegistryOptions {
    /// 64 slots, 64 participant entries, mode `0600`, 1 s initialisation wait, 2 s lock wait.
    pub fn new() -> Self {
        Self::default()
    }
    /// Number of slots (records) when creating: 1 to 65536.
    pub fn capacity(mut self, slots: u32) -> Self {
        self.slots = slots;
        self
    }
    /// Number of participant entries when creating: 1 to 4096.
    pub fn participants(mut self, n: u32) -> Self {
        self.participants = n;
        self
    }
    /// `true`: create with mode `0660`, and when opening accept a segment of another user of one of
    /// our groups whose mode is `0660` or stricter.
    pub fn group_access(mut self, on: bool) -> Self {
        self.group_access = on;
        self
    }
    /// How long `open` waits for a creator that is still initialising the segment.
    pub fn init_timeout(mut self, t: Duration) -> Self {
        self.init_timeout = t;
        self
    }
    /// How long an operation waits for a live writer that holds a slot or the table lock.
    pub fn lock_timeout(mut self, t: Duration) -> Self {
        self.lock_timeout = t;
        self
    }
    /// The configured number of slots.
    pub fn slots(&self) -> u32 {
        self.slots
    }
}

/// One published record, as copied out of its slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// The record's name (1 to 64 bytes of UTF-8).
    pub name: String,
    /// A caller-defined kind tag; the registry does not interpret it.
    pub kind: u32,
    /// The token bytes (at most 256), stored opaquely.
    pub token: Vec<u8>,
    /// User metadata (at most 128 bytes), stored opaquely.
    pub metadata: Vec<u8>,
    /// The process that published this version of the record.
    pub owner: ProcessIdentity,
    /// The effective uid the owner ran as: only a liveness file of this uid (or root's) counts for
    /// the owner ([`ProcessIdentity::liveness_as`]).
    pub owner_uid: u32,
    /// The record's sequence number: greater than every earlier number of this name.
    pub seq: u64,
    /// The slot index it sits in.
    pub slot: u32,
}

impl Record {
    /// Whether the publishing process still runs ([`ProcessIdentity::liveness_as`] with the
    /// recorded [`owner_uid`](Self::owner_uid)).
    pub fn owner_liveness(&self) -> Liveness {
        self.owner.liveness_as(self.owner_uid)
    }
}

/// A handle on a named registry segment.
///
/// Cheap to share between threads (`&Registry` suffices for every operation). Each handle holds one
/// participant entry, released on drop.
#[derive(Debug)]
pub struct Registry {
    seg: Segment,
    slots: u32,
    participants: u32,
    me: ProcessIdentity,
    /// This process's effective uid, recorded beside `me` (participant entry, records).
    uid: u32,
    /// The lock name this handle writes into lock words (0 for an inspection handle).
    lock_name: u64,
    /// The owner word of this handle's participant entry (0 for an inspection handle).
    owner: u64,
    participant: u32,
    lock_timeout: Duration,
    /// Device and inode of the mapped object, to tell whether the name still stands for it.
    file_id: (u64, u64),
    /// The creation generation in the header.
    generation: u64,
    /// The dead participants' entries this handle freed when it joined (empty for an inspection
    /// handle), for [`Registry::reclaimed_on_open`].
    freed_on_join: Vec<reclaim::Reclaimed>,
    /// The process (by fork) that joined: a forked child's copy writes nothing as its parent's
    /// participant and does not leave for it (`identity::fork`).
    pub(super) fork: ForkEpoch,
}

fn corrupt(name: &str, what: String) -> Error {
    RegistryError::Corrupt {
        name: name.to_string(),
        what,
    }
    .into()
}

/// `now + d`, saturating at about 136 years for timeouts too large for `Instant`.
fn deadline_after(d: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(d)
        .or_else(|| now.checked_add(Duration::from_secs(u64::from(u32::MAX))))
        .unwrap_or(now)
}

/// Says when a blocking call should look again whether its registry was superseded (every
/// [`SUPERSEDED_CHECK`]): the look costs a `stat`, so it is kept off the fast paths.
struct SlowPath {
    next: Instant,
}

impl SlowPath {
    fn new() -> Self {
        Self {
            next: deadline_after(SUPERSEDED_CHECK),
        }
    }

    fn due(&mut self) -> bool {
        let now = Instant::now();
        if now >= self.next {
            self.next = deadline_after(SUPERSEDED_CHECK);
            true
        } else {
            false
        }
    }
}

impl Registry {
    /// Whether the name still stands for the segment this handle mapped: `stat` of
    /// `/dev/shm/NAME` (never followed, nothing opened) against the mapped object's device and
    /// inode. A name that is gone is not a supersession: the mapping is still the registry its
    /// holders share.
    ///
    /// # Errors
    /// [`RegistryError::Superseded`] when another file now has the name.
    pub fn check_superseded(&self) -> Result<()> {
        use std::os::unix::fs::MetadataExt;
        let path = format!("{}/{}", crate::shm::SHM_DIR, self.name());
        match std::fs::symlink_metadata(&path) {
            Ok(m) if (m.dev(), m.ino()) != self.file_id => Err(RegistryError::Superseded {
                name: self.name().to_string(),
            }
            .into()),
            _ => Ok(()),
        }
    }

    /// The creation generation written in the header: random, different for every creation of
    /// the name.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    fn header_of(seg: &Segment) -> &Header {
        // The protocol's one cast of a mapping to its header (`shm::versioned::header`, whose
        // SAFETY comment discharges it under the contract `segment.rs` states for `Header`): the
        // mapping is at least HEADER_SIZE bytes (checked by every caller, asserted there) and
        // lives as long as `seg`; it is page-aligned; Header consists only of atomics, so a
        // shared reference to it permits the concurrent writes of other processes and no plain
        // byte is ever referenced; every bit pattern is a valid atomic integer.
        crate::shm::versioned::header::<Header>(seg)
    }

    fn header(&self) -> &Header {
        Self::header_of(&self.seg)
    }

    fn participant_at(&self, i: u32) -> &Participant {
        assert!(i < self.participants);
        // (1) `i < participants`, and the segment was checked at open/create to hold
        // total_size(participants, slots) bytes, so the entry is in bounds for the mapping, which
        // `self` keeps alive; (2) offset 128 + 64 i is 8-byte aligned.
        // SAFETY: (1), (2) above; (3) Participant is all atomics (see `header_of`); (4) any bit
        // pattern is valid.
        unsafe {
            &*(self
                .seg
                .as_ptr()
                .add(PARTICIPANTS_OFFSET + i as usize * PARTICIPANT_SIZE)
                as *const Participant)
        }
    }

    fn slot_at(&self, i: u32) -> &Slot {
        assert!(i < self.slots);
        // (1) `i < slots` and the mapping holds total_size(participants, slots) bytes (checked at
        // open/create), so the slot is in bounds and lives as long as `self`; (2) its offset is a
        // multiple of 64.
        // SAFETY: (1), (2) above; (3) Slot is all atomics (see `header_of`); (4) any bit pattern
        // is valid.
        unsafe {
            &*(self
                .seg
                .as_ptr()
                .add(slots_offset(self.participants) + i as usize * SLOT_SIZE)
                as *const Slot)
        }
    }

    fn view(&self, i: u32) -> SlotView<'_> {
        let s = self.slot_at(i);
        SlotView {
            writer: &s.writer,
            lock: crate::shm::SeqLock::new(&s.seq, &s.payload),
        }
    }

    /// The segment name (without `/`).
    pub fn name(&self) -> &str {
        self.seg.name()
    }

    /// The number of slots (most records at once).
    pub fn capacity(&self) -> u32 {
        self.slots
    }

    /// The identity this handle publishes under.
    pub fn identity(&self) -> ProcessIdentity {
        self.me
    }

    /// The participant entry index this handle holds.
    pub fn participant_index(&self) -> u32 {
        self.participant
    }

    /// The underlying segment (for diagnostics and tests).
    pub fn segment(&self) -> &Segment {
        &self.seg
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        if self.fork.inherited() {
            return; // the parent's participant entry (`identity::fork`)
        }
        if self.participant < self.participants {
            let p = self.participant_at(self.participant);
            // Release: pairs with the next claimer's Acquire compare-exchange.
            let _ = p
                .owner
                .compare_exchange(self.owner, 0, Ordering::Release, Ordering::Relaxed);
        }
    }
}
