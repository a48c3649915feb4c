//! Who serves a VMM tensor set's file descriptors: the holders segment `cuda-ipc.th.NAME`, the
//! [`Holder`] that keeps a set's fds and forwards them after its writer died, the writer's record of
//! the last whole generation, and a reader's fallback to holders.
//!
//! A VMM import holds its own reference to the physical memory, and so does an open fd of the
//! allocation: a set's memory lives while some process maps it or holds one of its fds. The driver
//! refuses to export an imported allocation again (`cuMemExportToShareableHandle` on an imported
//! handle: `CUDA_ERROR_INVALID_VALUE`), so a set survives its writer by forwarding the fds
//! themselves: a holder fetches every allocation's fd (from the writer, or from another holder),
//! keeps it in this process's [`FdExport`](crate::ipc::fdpass::FdExport) table and records its
//! export ids in a slot of the holders segment; a new reader whose writer is dead fetches the fds
//! from any live slot ([`crate::ipc::fdpass::fetch_many`] checks that the server is the identity the
//! slot names) and imports them. Only VMM sets are held: a pool allocation imported in another
//! process is undefined once its exporter frees it, and legacy IPC handles carry no fd.
//!
//! A held fd pins the set's device memory (B × bytes per buffer) even when nothing maps it. Quota
//! ledgers are charged by the writer only (its reservation goes back when it dies or closes), so
//! device memory that holders keep after that is not in any ledger: count it with `cuda-ipc ls`.
//!
//! # The holders segment
//! Made by the writer of a VMM set before its manifest (whose body records its creation generation
//! at offset 152), mode 0600, the `shm::versioned` protocol with the manifest's header words
//! (`segment.rs`: magic `CIPCTSHD`, the writer's identity, `body_len` = the slot area's bytes,
//! `buffers` = B). Further words of the header page, at byte 128 (`Words`):
//!
//! | offset | field |
//! | --- | --- |
//! | 128 | slots `u32`, 132: entries per slot E = B × A `u32`, 136: allocations per buffer A `u32`, 140: zero |
//! | 144 | layout fingerprint (32 bytes), 176: bytes per buffer `u64` (what a restarted writer checks) |
//! | 184 | writing marker `u64`: `generation << 8 \| (buffer + 1)` of the update begun last (0: none) |
//! | 192 | record sequence `u64` (odd while written), 200: whole generation `u64`, 208: its buffer `u64`, 216: its content fingerprint (32 bytes) |
//!
//! Then, from byte 4096, `slots` slots of `round_up(64 + 4 E, 8)` bytes (`SlotHead`, then E export
//! ids `u32`: the id of allocation (b, a) in the server's own fd table, index b × A + a):
//!
//! | offset | field |
//! | --- | --- |
//! | 0 | state word `u64`: bits 0–1 FREE 0 / WRITING 1 / SERVING 2, bits 2–31 a sequence bumped on every change, bits 32–63 unix seconds of the change |
//! | 8 | role `u32` (1 writer, 2 reader, 3 holder, 4 writerless reader: serves nothing), 12: effective uid `u32` |
//! | 16 | the server's [`ProcessIdentity`] words (32 bytes), 48: unix ms since it serves `u64` |
//! | 56 | reading word `u64` (writerless readers): buffer + 1 that one of its guards holds, 0: none |
//! | 64 | E export ids `u32` (all zero for a writerless reader) |
//!
//! A claim CASes the exact word it observed (FREE, SERVING of a dead process, or WRITING of a dead
//! process for more than [`WRITING_STALE_SECS`]) to WRITING with the next sequence, writes the
//! fields, and CASes that word to SERVING (`Release`); letting go CASes the SERVING word to FREE. A
//! dead server's slot is thus reused without ABA, and a slot's fields change only while it is
//! WRITING. Readers copy a slot seqlock-style: the state (`Acquire`), the fields, an `Acquire`
//! fence, the state again; a slot whose two words differ is read again.
//!
//! # The last whole generation
//! The writer stores the writing marker in [`crate::tensorset::TensorSetWriter::begin`] before
//! anything writes the buffer, and (generation, buffer, content) into the seqlock'd record once
//! the generation's GPU work is known complete (an event recorded after the commit's work on the
//! writer's stream, waited for by the writer's recorder thread; the commit never waits). A record
//! (G, b) is whole unless the marker names buffer b with a generation after G: after the writer's
//! death, a reader opens the set at that generation. In place (B = 1) an update that was under way
//! when the writer died leaves no whole generation.
//!
//! A writer's deliberate close (or drop) unlinks the holders segment it made: holders see the name
//! no longer stands for their segment and let go.
//!
//! # Restart without reload
//! A VMM writer created under the name of a dead writer's set whose holders segment has a live
//! holder, a whole generation, and the layout fingerprint, bytes per buffer, buffer count and
//! allocation count it asks for (`resume::decide`, from this header's words) *resumes*: it
//! fetches every fd from a holder, imports them read-write, serves them itself, claims the writer's
//! slot in this same segment (the header stays), and publishes the last whole generation again as
//! its first (the manifest's generation base keeps the numbers going). Anything else (another
//! layout, no live holder, [`crate::tensorset::TensorSetOptions::resume`] off) replaces the set:
//! the old holders see a new holders segment under the name and let go.
//!
//! Writerless readers (opened while the writer was dead) claim a slot of role
//! [`HolderRole::WriterlessReader`] and store in its reading word the buffer their guards hold;
//! a resumed writer does not write that buffer while a live one holds it, and such a reader takes
//! no generation once a live writer has a slot (it reopens).

mod holder;
mod recorder;
pub(crate) mod resume;
mod role;
mod writerless;

pub(crate) use holder::{FdSource, Serving, fetch_all};
pub use holder::{Holder, HolderStatus};
pub(crate) use recorder::Recorder;
pub use role::{HolderRole, HolderSnapshot};
pub(crate) use writerless::Writerless;

use super::error::{ManifestFault, TensorSetError};
use super::segment::{self, HEADER_PAGE, HOLDERS_MAGIC, HOLDERS_PREFIX, HoldersHeader, INIT_WAIT};
use crate::error::{Error, Result};
use crate::identity::ForkEpoch;
use crate::identity::{Liveness, ProcessIdentity};
use crate::shm::versioned::{self, VersionedHeader};
use crate::shm::{Segment, ShmError};
use crate::sync::{AtomicU32, AtomicU64, Ordering, fence};

/// Most export ids in one slot (B × A): a set with more allocations cannot be held by forwarding.
pub const MAX_HOLDER_ENTRIES: usize = 1024;
/// Slots of a holders segment: servers of one set at once (the writer, serving readers, holders).
pub const HOLDER_SLOTS: usize = 64;
/// The most slots an open accepts in a holders segment's header.
const MAX_HOLDER_SLOTS: usize = 4096;
/// A slot left WRITING this many seconds by a dead process is taken again.
pub const WRITING_STALE_SECS: u64 = 10;
/// Where [`Words`] lie in the header page.
const WORDS_AT: usize = 128;
/// Bytes of a slot before its export ids.
const SLOT_HEAD: usize = 64;

const FREE: u64 = 0;
const WRITING: u64 = 1;
const SERVING: u64 = 2;
const SEQ_MASK: u64 = (1 << 30) - 1;

/// The holders segment's words after the shared header (at [`WORDS_AT`]).
#[repr(C)]
struct Words {
    slots: AtomicU32,
    entries: AtomicU32,
    allocations: AtomicU32,
    _pad: AtomicU32,
    fingerprint: [AtomicU64; 4],
    bytes_per_buffer: AtomicU64,
    writing: AtomicU64,
    rec_seq: AtomicU64,
    rec_generation: AtomicU64,
    rec_buffer: AtomicU64,
    rec_content: [AtomicU64; 4],
}

/// A slot's words before its export ids.
#[repr(C)]
struct SlotHead {
    state: AtomicU64,
    role: AtomicU32,
    uid: AtomicU32,
    who: [AtomicU64; 4],
    since_ms: AtomicU64,
    reading: AtomicU64,
}

#[cfg(not(loom))]
const _: () = {
    assert!(std::mem::size_of::<Words>() == 120);
    assert!(std::mem::offset_of!(Words, writing) == 184 - WORDS_AT);
    assert!(std::mem::offset_of!(Words, rec_seq) == 192 - WORDS_AT);
    assert!(WORDS_AT + std::mem::size_of::<Words>() <= HEADER_PAGE);
    assert!(std::mem::size_of::<SlotHead>() == SLOT_HEAD);
};

/// A serving slot with its export ids (for fetches).
#[derive(Clone, Debug)]
pub(crate) struct Server {
    pub(crate) slot: usize,
    pub(crate) role: HolderRole,
    pub(crate) identity: ProcessIdentity,
    pub(crate) uid: u32,
    pub(crate) since_ms: u64,
    pub(crate) ids: Vec<u32>,
}

/// A slot this process claimed: let go with [`HoldersSegment::release`].
#[derive(Debug)]
pub(crate) struct SlotClaim {
    index: usize,
    word: u64,
}

/// What the record of the last whole generation says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Whole {
    /// Generation `generation` in buffer `buffer` is whole (its GPU work completed, its buffer not
    /// written since).
    Generation {
        generation: u64,
        buffer: usize,
        content: [u8; 32],
    },
    /// None, and why.
    None(&'static str),
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// The state word after `word` with state `state`: the next sequence, now's seconds.
fn next(word: u64, state: u64) -> u64 {
    let seq = ((word >> 2) + 1) & SEQ_MASK;
    (now_secs() << 32) | (seq << 2) | state
}

/// Bytes of one slot with `entries` export ids.
fn slot_len(entries: usize) -> usize {
    (SLOT_HEAD + 4 * entries).next_multiple_of(8)
}

/// An open holders segment.
pub(crate) struct HoldersSegment {
    seg: Segment,
    set: String,
    generation: u64,
    slots: usize,
    entries: usize,
    buffers: usize,
    slot_len: usize,
    /// The process (by fork) that mapped it: a forked child's copy releases no slot, clears no
    /// reading word and unlinks nothing (`identity::fork`).
    fork: ForkEpoch,
}

impl std::fmt::Debug for HoldersSegment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HoldersSegment")
            .field("name", &self.seg.name())
            .field("slots", &self.slots)
            .field("entries", &self.entries)
            .finish_non_exhaustive()
    }
}

/// The [`Words`] of `seg` (at least a header page long).
fn words(seg: &Segment) -> &Words {
    assert!(
        seg.len() >= HEADER_PAGE,
        "a segment shorter than its header"
    );
    // SAFETY: (1) the mapping (borrowed with `seg`) holds HEADER_PAGE >= WORDS_AT + size_of Words
    // bytes (asserted at compile time); (2) it starts on a page and WORDS_AT is a multiple of 8,
    // Words' alignment; (3) Words is atomics only: any bit pattern is valid, and a shared
    // reference permits other processes' concurrent writes.
    unsafe { &*seg.as_ptr().add(WORDS_AT).cast::<Words>() }
}

/// Whether the holders segment `seg` (at least a header page long), found without its stamp, shows
/// use that only follows the stamp ([`segment::ShowsUse`]): words its creator leaves zero (zero
/// from `ftruncate`; [`HoldersSegment::create`] writes only the counts, the fingerprint and the
/// bytes per buffer) and that only a process of the stamped segment writes: the writing marker,
/// the record's sequence or generation, or a slot's state word (every claim bumps its sequence,
/// so it is never 0 again). The slots are read where the recorded counts are in the ranges an
/// open accepts and the mapping holds them.
pub(crate) fn used_since_stamped(seg: &Segment) -> bool {
    let w = words(seg);
    // Relaxed (every load here): a look at single words; nothing is read through them.
    if [&w.writing, &w.rec_seq, &w.rec_generation]
        .iter()
        .any(|word| word.load(Ordering::Relaxed) != 0)
    {
        return true;
    }
    let slots = w.slots.load(Ordering::Relaxed) as usize;
    let entries = w.entries.load(Ordering::Relaxed) as usize;
    if !(1..=MAX_HOLDER_SLOTS).contains(&slots) || !(1..=MAX_HOLDER_ENTRIES).contains(&entries) {
        return false;
    }
    let slot_len = slot_len(entries);
    let in_map = (seg.len() - HEADER_PAGE) / slot_len;
    (0..slots.min(in_map)).any(|i| {
        let at = HEADER_PAGE + i * slot_len;
        // SAFETY: (1) `i < in_map`: the slot's head lies within the mapping, which `seg` keeps
        // alive; (2) `at` is a multiple of 8 (a page plus multiples of the 8-byte slot length),
        // the head's alignment; (3) atomics only: any bit pattern is valid and other processes
        // may write them concurrently.
        let head = unsafe { &*seg.as_ptr().add(at).cast::<SlotHead>() };
        head.state.load(Ordering::Relaxed) != 0
    })
}

/// The error for a set that cannot be held.
fn not_holdable(set: &str, why: String) -> Error {
    TensorSetError::NotHoldable {
        name: set.to_string(),
        why,
    }
    .into()
}

/// Checks that B × A allocations fit a slot.
pub(crate) fn check_entries(set: &str, buffers: usize, allocations: usize) -> Result<usize> {
    let e = buffers.saturating_mul(allocations);
    if e == 0 || e > MAX_HOLDER_ENTRIES {
        return Err(not_holdable(
            set,
            format!(
                "{buffers} buffers × {allocations} allocations = {e} file descriptors; a holder \
                 forwards at most {MAX_HOLDER_ENTRIES} (MAX_HOLDER_ENTRIES)"
            ),
        ));
    }
    Ok(e)
}

impl HoldersSegment {
    /// Creates the holders segment of `set` (replacing only what a new writer may replace:
    /// `segment::replaceable`), with [`HOLDER_SLOTS`] free slots of B × A ids.
    ///
    /// # Errors
    /// [`TensorSetError::NotHoldable`] past [`MAX_HOLDER_ENTRIES`]; as the manifest's creation.
    pub(crate) fn create(
        set: &str,
        buffers: usize,
        allocations: usize,
        fingerprint: [u8; 32],
        bytes_per_buffer: u64,
    ) -> Result<HoldersSegment> {
        let entries = check_entries(set, buffers, allocations)?;
        let slot_len = slot_len(entries);
        let area = HOLDER_SLOTS * slot_len;
        let len = (HEADER_PAGE + area).next_multiple_of(HEADER_PAGE);
        let name = format!("{HOLDERS_PREFIX}{set}");
        let (seg, generation) =
            segment::create::<HOLDERS_MAGIC>(set, &name, len, used_since_stamped, |seg, h| {
                h.set_body(area as u64, buffers as u32);
                let w = words(seg);
                // Relaxed: published by the stamp's Release store (`write_versioned`); the slots are
                // zero (FREE) in a new segment.
                w.slots.store(HOLDER_SLOTS as u32, Ordering::Relaxed);
                w.entries.store(entries as u32, Ordering::Relaxed);
                w.allocations.store(allocations as u32, Ordering::Relaxed);
                for (i, c) in fingerprint.chunks_exact(8).enumerate() {
                    let v = u64::from_le_bytes(c.try_into().unwrap_or_default());
                    w.fingerprint[i].store(v, Ordering::Relaxed);
                }
                w.bytes_per_buffer
                    .store(bytes_per_buffer, Ordering::Relaxed);
            })?;
        Ok(HoldersSegment {
            seg,
            set: set.to_string(),
            generation,
            slots: HOLDER_SLOTS,
            entries,
            buffers,
            slot_len,
            fork: ForkEpoch::now(),
        })
    }

    /// Opens the holders segment of `set`; with `expect` = (creation generation, B, A) from the
    /// manifest, checks that it is the one the manifest names.
    ///
    /// # Errors
    /// The segment's own errors ([`crate::Error::Shm`]: missing, another user's, sparse, too
    /// small); [`TensorSetError::BadManifest`] naming the holders segment for a foreign magic,
    /// counts out of range, a size that does not hold the slots, or another generation than
    /// expected ([`ManifestFault::Mismatch`]); [`TensorSetError::VersionMismatch`];
    /// [`TensorSetError::CreationInProgress`] when the stamp did not come within 2 s and no writer
    /// is recorded yet (or was recorded too late in the wait to tell);
    /// [`TensorSetError::BadManifest`] for a creation abandoned half-way, and for a stamp still 0
    /// after 2 s while the writer recorded runs and had recorded itself at least 500 ms before
    /// (a header overwritten).
    pub(crate) fn open(set: &str, expect: Option<(u64, usize, usize)>) -> Result<HoldersSegment> {
        Self::open_waiting(set, expect, INIT_WAIT)
    }

    /// [`HoldersSegment::open`], waiting at most `wait` for the stamp of a segment whose writer
    /// may still write it (zero: one look; a holder claims a slot only in a stamped segment, so
    /// an unstamped one serves nobody).
    ///
    /// # Errors
    /// As [`HoldersSegment::open`].
    pub(crate) fn open_waiting(
        set: &str,
        expect: Option<(u64, usize, usize)>,
        wait: std::time::Duration,
    ) -> Result<HoldersSegment> {
        segment::validate_set_name(set)?;
        let name = format!("{HOLDERS_PREFIX}{set}");
        let seg = segment::open_segment::<HOLDERS_MAGIC>(&name, wait, used_since_stamped)
            .map_err(|e| segment::open_error(set, &name, e))?;
        Self::from_segment(set, seg, expect)
    }

    fn from_segment(
        set: &str,
        seg: Segment,
        expect: Option<(u64, usize, usize)>,
    ) -> Result<HoldersSegment> {
        let name = seg.name().to_string();
        let h = versioned::header::<HoldersHeader>(&seg);
        let w = words(&seg);
        // Relaxed: written before the stamp, which `open_versioned` Acquire-loaded.
        let generation = h.generation().load(Ordering::Relaxed);
        let slots = w.slots.load(Ordering::Relaxed) as usize;
        let entries = w.entries.load(Ordering::Relaxed) as usize;
        let allocations = w.allocations.load(Ordering::Relaxed) as usize;
        let buffers = h.buffers() as usize;
        let field = |what, found: usize, allowed| {
            segment::bad(
                &name,
                ManifestFault::Field {
                    what,
                    found: found as u64,
                    allowed,
                },
            )
        };
        if !(1..=MAX_HOLDER_SLOTS).contains(&slots) {
            return Err(field("the holder slot count", slots, "1 to 4096"));
        }
        if !(1..=MAX_HOLDER_ENTRIES).contains(&entries) {
            return Err(field("the entries per slot", entries, "1 to 1024"));
        }
        if allocations == 0 || buffers.checked_mul(allocations) != Some(entries) {
            return Err(field(
                "the entries per slot",
                entries,
                "buffers × allocations",
            ));
        }
        let slot_len = slot_len(entries);
        let area = slots * slot_len;
        if h.body_len() != area as u64 {
            return Err(field(
                "the slot area's length",
                h.body_len() as usize,
                "slots × slot length",
            ));
        }
        if seg.len() < HEADER_PAGE + area {
            return Err(segment::bad(
                &name,
                ManifestFault::Truncated {
                    what: "its holder slots",
                    len: seg.len() as u64,
                    need: (HEADER_PAGE + area) as u64,
                },
            ));
        }
        if let Some((g, b, a)) = expect
            && (g != generation || b != buffers || a != allocations)
        {
            return Err(segment::bad(
                &name,
                ManifestFault::Mismatch {
                    what: "the holders segment",
                },
            ));
        }
        Ok(HoldersSegment {
            seg,
            set: set.to_string(),
            generation,
            slots,
            entries,
            buffers,
            slot_len,
            fork: ForkEpoch::now(),
        })
    }

    /// The segment's name.
    pub(crate) fn name(&self) -> &str {
        self.seg.name()
    }

    /// The mapped segment.
    pub(crate) fn segment(&self) -> &Segment {
        &self.seg
    }

    /// Its creation generation (what the manifest records).
    pub(crate) fn generation(&self) -> u64 {
        self.generation
    }

    /// Entries per slot: B × A.
    pub(crate) fn entries(&self) -> usize {
        self.entries
    }

    fn words(&self) -> &Words {
        words(&self.seg)
    }

    /// Slot `i`'s head and export ids.
    fn slot(&self, i: usize) -> (&SlotHead, &[AtomicU32]) {
        assert!(i < self.slots);
        let at = HEADER_PAGE + i * self.slot_len;
        // SAFETY: (1) `at + slot_len <= seg.len()` (checked at create/open): head and ids lie in
        // the mapping, which lives as long as `self`; (2) `at` is a multiple of 8 (the head's
        // alignment), `at + SLOT_HEAD` of 4 (the ids'); (3) atomics only: any bit pattern is
        // valid and other processes may write them concurrently.
        unsafe {
            let p = self.seg.as_ptr().add(at);
            (
                &*p.cast::<SlotHead>(),
                std::slice::from_raw_parts(p.add(SLOT_HEAD).cast::<AtomicU32>(), self.entries),
            )
        }
    }

    /// A consistent copy of slot `i` while it is SERVING (`None`: not serving, or changing on
    /// every look).
    fn read_slot(&self, i: usize) -> Option<Server> {
        let (head, ids) = self.slot(i);
        for _ in 0..64 {
            // SYNC POINT slot: Acquire, pairs with the Release CAS to SERVING in `claim`: the
            // fields read below are the claimer's (validated by the re-check).
            let s1 = head.state.load(Ordering::Acquire);
            if s1 & 3 != SERVING {
                return None;
            }
            // Relaxed: validated by the re-check after the fence.
            let role = head.role.load(Ordering::Relaxed);
            let uid = head.uid.load(Ordering::Relaxed);
            let who = ProcessIdentity::load_words(&head.who);
            let since_ms = head.since_ms.load(Ordering::Relaxed);
            let v: Vec<u32> = ids.iter().map(|x| x.load(Ordering::Relaxed)).collect();
            // SYNC POINT slot fields: Acquire fence, pairs with the Release fence after the CAS to
            // WRITING in `claim`: a field store seen above makes the re-load see that WRITING.
            fence(Ordering::Acquire);
            if head.state.load(Ordering::Relaxed) == s1 {
                return Some(Server {
                    slot: i,
                    role: HolderRole::from_code(role)?,
                    identity: who,
                    uid,
                    since_ms,
                    ids: v,
                });
            }
            std::thread::yield_now();
        }
        None
    }

    /// Every serving slot, as read now (dead servers included); none when the segment was cut
    /// short under this mapping ([`Segment::check_intact`]: never touched then).
    pub(crate) fn servers(&self) -> Vec<Server> {
        if let Err(e) = self.seg.check_intact() {
            tracing::warn!("holders segment not read: {e}");
            return Vec::new();
        }
        (0..self.slots).filter_map(|i| self.read_slot(i)).collect()
    }

    /// The serving slots with their servers' liveness.
    pub(crate) fn snapshot(&self) -> Vec<HolderSnapshot> {
        self.servers()
            .into_iter()
            .map(|s| HolderSnapshot {
                slot: s.slot,
                role: s.role,
                liveness: s.identity.liveness_as(s.uid),
                identity: s.identity,
                uid: s.uid,
                since_ms: s.since_ms,
            })
            .collect()
    }

    /// Frees the slots of servers that are dead (their identity judged with their uid; unknown
    /// liveness is kept), each from the exact SERVING word judged to FREE with the next sequence,
    /// as a claimer would take it over; returns those freed. A slot claimed or let go meanwhile
    /// changed its word and is left alone. For `gc`: claimers reuse such slots anyway.
    pub(crate) fn free_dead(&self) -> Vec<HolderSnapshot> {
        let mut freed = Vec::new();
        for s in self.snapshot() {
            if s.liveness != Liveness::Dead {
                continue;
            }
            let (head, _) = self.slot(s.slot);
            // SYNC POINT free: Acquire, pairs with the Release CAS to SERVING in `claim`.
            let w = head.state.load(Ordering::Acquire);
            // The word still SERVING by the server judged: same identity under the same word.
            let same = w & 3 == SERVING
                && self
                    .read_slot(s.slot)
                    .is_some_and(|x| x.identity == s.identity && x.uid == s.uid)
                && head.state.load(Ordering::Acquire) == w;
            // SYNC POINT free: Release, pairs with the Acquire CAS of the next claimer.
            if same
                && head
                    .state
                    .compare_exchange(w, next(w, FREE), Ordering::Release, Ordering::Relaxed)
                    .is_ok()
            {
                freed.push(s);
            }
        }
        freed
    }

    /// Whether some live (or unknown) process other than the recorded writer serves the set.
    pub(crate) fn held_by_live(&self) -> bool {
        self.live_holders() > 0
    }

    /// How many live (or unknown) processes other than a writer serve the set's fds.
    pub(crate) fn live_holders(&self) -> usize {
        self.servers()
            .iter()
            .filter(|s| {
                s.role != HolderRole::Writer
                    && s.role.serves()
                    && s.identity.liveness_as(s.uid) != Liveness::Dead
            })
            .count()
    }

    /// Whether a live (or unknown) writer has a slot: a set resumed after its writer's death.
    pub(crate) fn has_live_writer(&self) -> bool {
        self.servers().iter().any(|s| {
            s.role == HolderRole::Writer && s.identity.liveness_as(s.uid) != Liveness::Dead
        })
    }

    /// What the header records of the set's memory, for a restarted writer
    /// ([`resume::decide`]).
    ///
    /// # Errors
    /// [`ShmError::Shrunk`] when the segment was cut short under this mapping.
    pub(crate) fn memory_facts(&self) -> Result<resume::MemoryFacts> {
        self.seg.check_intact()?;
        let w = self.words();
        let mut fingerprint = [0u8; 32];
        for (i, c) in fingerprint.chunks_exact_mut(8).enumerate() {
            // Relaxed: written before the stamp, which the open Acquire-loaded.
            c.copy_from_slice(&w.fingerprint[i].load(Ordering::Relaxed).to_le_bytes());
        }
        Ok(resume::MemoryFacts {
            fingerprint,
            // Relaxed: as above.
            bytes_per_buffer: w.bytes_per_buffer.load(Ordering::Relaxed),
            buffers: self.buffers,
            allocations: self.entries / self.buffers.max(1),
        })
    }

    /// Claims a slot for a writerless reader (role [`HolderRole::WriterlessReader`], no export
    /// ids, reading nothing yet).
    ///
    /// # Errors
    /// As [`HoldersSegment::claim`].
    pub(crate) fn claim_reading(&self) -> Result<SlotClaim> {
        self.claim(HolderRole::WriterlessReader, &vec![0; self.entries])
    }

    /// Stores in `claim`'s slot the buffer its guards hold (`None`: none), then looks whether a
    /// live writer has a slot: `true` means the set was resumed, and a hold just stored must be
    /// withdrawn (the writer may not have seen it).
    ///
    /// # Errors
    /// [`ShmError::Shrunk`] when the segment was cut short under this mapping (nothing stored);
    /// [`Error::ForkedChild`] in a process forked from the one that mapped it (the slot is the
    /// parent's).
    pub(crate) fn set_reading(&self, claim: &SlotClaim, buffer: Option<usize>) -> Result<bool> {
        self.fork.check("tensor set holder slot")?;
        self.seg.check_intact()?;
        let (head, _) = self.slot(claim.index);
        // SYNC POINT reading: SeqCst, pairs with the SeqCst fence in `reading_held` (a Dekker
        // pair with the writer's slot claim): either the resumed writer sees this hold, or this
        // reader sees the writer's slot below.
        head.reading
            .store(buffer.map_or(0, |b| b as u64 + 1), Ordering::SeqCst);
        fence(Ordering::SeqCst);
        Ok(buffer.is_some() && self.has_live_writer())
    }

    /// Whether a live writerless reader's guard holds `buffer` (the resumed writer, after its
    /// writing marker and before it writes the buffer). `false` for a segment cut short under this
    /// mapping (no slot is readable: [`Self::servers`] finds none).
    pub(crate) fn reading_held(&self, buffer: usize) -> bool {
        if self.seg.check_intact().is_err() {
            return false;
        }
        // SYNC POINT reading: SeqCst fence, pairs with the SeqCst store and fence in
        // `set_reading`.
        fence(Ordering::SeqCst);
        (0..self.slots).any(|i| {
            let (head, _) = self.slot(i);
            head.reading.load(Ordering::SeqCst) == buffer as u64 + 1
                && self.read_slot(i).is_some_and(|s| {
                    s.role == HolderRole::WriterlessReader
                        && s.identity.liveness_as(s.uid) != Liveness::Dead
                })
        })
    }

    /// Claims a slot for this process in `role`, serving `ids` (B × A export ids, index b × A + a):
    /// a FREE slot, a dead process's SERVING slot, or one a dead process left WRITING more than
    /// [`WRITING_STALE_SECS`] ago.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a wrong id count; [`TensorSetError::NoHolderSlot`] when every
    /// slot serves a live process; [`Error::Os`] when this process's identity cannot be read;
    /// [`ShmError::Shrunk`] when the segment was cut short under this mapping.
    pub(crate) fn claim(&self, role: HolderRole, ids: &[u32]) -> Result<SlotClaim> {
        let me = ProcessIdentity::current()?;
        self.claim_as(role, ids, me, rustix::process::geteuid().as_raw())
    }

    /// [`Self::claim`] recording `me` with `uid` as the slot's server (tests: a slot of another
    /// process).
    pub(crate) fn claim_as(
        &self,
        role: HolderRole,
        ids: &[u32],
        me: ProcessIdentity,
        uid: u32,
    ) -> Result<SlotClaim> {
        self.seg.check_intact()?;
        if ids.len() != self.entries {
            return Err(Error::InvalidArgument(format!(
                "{} export ids for a slot of {}",
                ids.len(),
                self.entries
            )));
        }
        for i in 0..self.slots {
            let (head, slot_ids) = self.slot(i);
            // Relaxed: only a candidate; the CAS below decides, from this exact word.
            let w = head.state.load(Ordering::Relaxed);
            let free = match w & 3 {
                FREE => true,
                SERVING => self
                    .read_slot(i)
                    .is_some_and(|s| s.identity.liveness_as(s.uid) == Liveness::Dead),
                _ => {
                    // WRITING: a claimer between its two CASes, for microseconds; one that died
                    // there is judged by the identity it wrote, once the word is old.
                    let old = now_secs().saturating_sub(w >> 32) > WRITING_STALE_SECS;
                    old && {
                        let who = ProcessIdentity::load_words(&head.who);
                        who.liveness_as(head.uid.load(Ordering::Relaxed)) == Liveness::Dead
                    }
                }
            };
            if !free {
                continue;
            }
            let writing = next(w, WRITING);
            // SYNC POINT claim: AcqRel CAS from the exact word observed (no ABA: the sequence
            // changes on every transition). Acquire pairs with the Release CAS of the slot's last
            // owner (to FREE or SERVING).
            if head
                .state
                .compare_exchange(w, writing, Ordering::AcqRel, Ordering::Relaxed)
                .is_err()
            {
                continue;
            }
            // SYNC POINT slot fields: Release fence, pairs with the Acquire fence in `read_slot`.
            fence(Ordering::Release);
            // Relaxed: published by the Release CAS to SERVING below.
            head.role.store(role.code(), Ordering::Relaxed);
            head.uid.store(uid, Ordering::Relaxed);
            me.store_words(&head.who);
            head.since_ms.store(now_ms(), Ordering::Relaxed);
            head.reading.store(0, Ordering::Relaxed);
            for (s, &id) in slot_ids.iter().zip(ids) {
                s.store(id, Ordering::Relaxed);
            }
            let serving = next(writing, SERVING);
            // SYNC POINT slot: Release, pairs with the Acquire load in `read_slot`. A CAS: a slot
            // judged stale meanwhile (only after WRITING_STALE_SECS) is left to its new owner.
            if head
                .state
                .compare_exchange(writing, serving, Ordering::Release, Ordering::Relaxed)
                .is_ok()
            {
                return Ok(SlotClaim {
                    index: i,
                    word: serving,
                });
            }
        }
        Err(TensorSetError::NoHolderSlot {
            name: self.set.clone(),
            slots: self.slots,
        }
        .into())
    }

    /// Lets go of `claim`'s slot (FREE, next sequence); a slot taken over meanwhile is left alone.
    pub(crate) fn release(&self, claim: SlotClaim) {
        if self.fork.inherited() {
            return; // the parent's slot (`identity::fork`)
        }
        if let Err(e) = self.seg.check_intact() {
            tracing::warn!("holder slot {} left as it is: {e}", claim.index);
            return;
        }
        let (head, _) = self.slot(claim.index);
        // SYNC POINT release: Release, pairs with the Acquire CAS of the next claimer.
        if head
            .state
            .compare_exchange(
                claim.word,
                next(claim.word, FREE),
                Ordering::Release,
                Ordering::Relaxed,
            )
            .is_err()
        {
            tracing::warn!(
                "holder slot {} of {} was taken over while this process served it",
                claim.index,
                self.seg.name()
            );
        }
    }

    /// Stores "generation `generation` is being written into buffer `buffer`" (the writer, before
    /// anything writes the buffer).
    /// Nothing is stored in a segment cut short under this mapping (logged: a reader then finds no
    /// whole generation there).
    pub(crate) fn mark_writing(&self, generation: u64, buffer: usize) {
        if let Err(e) = self.seg.check_intact() {
            tracing::warn!("writing marker not stored: {e}");
            return;
        }
        // SYNC POINT marker: Release, pairs with the Acquire load in `last_whole`.
        self.words()
            .writing
            .store((generation << 8) | (buffer as u64 + 1), Ordering::Release);
    }

    /// Records generation `generation` in `buffer` with `content` as whole (its GPU work done).
    /// One writer at a time (the writer's recorder lock).
    /// Nothing is stored in a segment cut short under this mapping (logged).
    pub(crate) fn record_whole(&self, generation: u64, buffer: usize, content: &[u8; 32]) {
        if let Err(e) = self.seg.check_intact() {
            tracing::warn!("whole generation {generation} not recorded: {e}");
            return;
        }
        let w = self.words();
        // Relaxed: only this process writes the record, under its lock.
        let seq = w.rec_seq.load(Ordering::Relaxed);
        let odd = seq | 1;
        w.rec_seq.store(odd, Ordering::Relaxed);
        // SYNC POINT record: Release fence, pairs with the Acquire fence in `last_whole`.
        fence(Ordering::Release);
        // Relaxed: published by the Release store of the even sequence below.
        w.rec_generation.store(generation, Ordering::Relaxed);
        w.rec_buffer.store(buffer as u64, Ordering::Relaxed);
        for (i, c) in content.chunks_exact(8).enumerate() {
            let v = u64::from_le_bytes(c.try_into().unwrap_or_default());
            w.rec_content[i].store(v, Ordering::Relaxed);
        }
        // SYNC POINT record: Release, pairs with the Acquire load in `last_whole`.
        w.rec_seq.store(odd.wrapping_add(1), Ordering::Release);
    }

    /// The last whole generation, or why there is none.
    pub(crate) fn last_whole(&self) -> Whole {
        if self.seg.check_intact().is_err() {
            return Whole::None("the holders segment was cut short after it was mapped");
        }
        let w = self.words();
        for _ in 0..1000 {
            // SYNC POINT record: Acquire, pairs with the Release store of the even sequence in
            // `record_whole`.
            let s1 = w.rec_seq.load(Ordering::Acquire);
            if s1 == 0 {
                return Whole::None("no generation's GPU work was known complete");
            }
            if s1 & 1 == 1 {
                std::thread::yield_now();
                continue;
            }
            // Relaxed: validated by the re-check after the fence.
            let generation = w.rec_generation.load(Ordering::Relaxed);
            let buffer = w.rec_buffer.load(Ordering::Relaxed);
            let mut content = [0u8; 32];
            for (i, c) in content.chunks_exact_mut(8).enumerate() {
                c.copy_from_slice(&w.rec_content[i].load(Ordering::Relaxed).to_le_bytes());
            }
            // SYNC POINT record: Acquire fence, pairs with the Release fence in `record_whole`.
            fence(Ordering::Acquire);
            if w.rec_seq.load(Ordering::Relaxed) != s1 {
                continue;
            }
            if buffer >= self.buffers as u64 {
                return Whole::None("the record names a buffer the set does not have");
            }
            // SYNC POINT marker: Acquire, pairs with the Release store in `mark_writing`.
            let m = w.writing.load(Ordering::Acquire);
            if m & 0xff == buffer + 1 && m >> 8 > generation {
                return Whole::None(
                    "an update of the buffer that held the last whole generation was under way \
                     (in place, an update the writer did not finish leaves no whole generation)",
                );
            }
            return Whole::Generation {
                generation,
                buffer: buffer as usize,
                content,
            };
        }
        Whole::None("the record was being written when the writer stopped")
    }

    /// Unlinks the name while it still stands for this segment.
    pub(crate) fn unlink(&self) {
        if self.fork.inherited() {
            return; // the parent's set (`identity::fork`)
        }
        segment::unlink_own(&self.seg);
    }
}

/// What tools read of a holders segment: its serving slots, the last whole generation, the
/// segment's creation generation.
pub(crate) type HoldersView = (Vec<HolderSnapshot>, Option<u64>, u64);

/// The holders of set `name`, its last whole generation and the segment's creation generation,
/// for tools (`Ok(None)`: the set has no holders segment).
///
/// # Errors
/// As the holders segment's open, less a missing one.
pub(crate) fn inspect_holders(name: &str) -> Result<Option<HoldersView>> {
    match HoldersSegment::open(name, None) {
        Ok(h) => {
            let whole = match h.last_whole() {
                Whole::Generation { generation, .. } => Some(generation),
                Whole::None(_) => None,
            };
            Ok(Some((h.snapshot(), whole, h.generation())))
        }
        Err(Error::Shm(ShmError::NotFound { .. })) => Ok(None),
        Err(e) => Err(e),
    }
}

#[cfg(all(test, not(loom)))]
mod tests;

#[cfg(all(test, not(loom)))]
mod hostile;

pub(crate) mod testing;
