//! The registry: a named POSIX shared-memory segment of fixed-layout slots carrying published handles,
//! sequence numbers and the liveness of every participant. It stores handles as bytes and never calls
//! CUDA.
//!
//! Owns: [`Registry`] (create / open / publish / get / wait / list / remove / reclaim), [`Record`],
//! [`RegistryError`] and the byte layout in [`layout`] (described for C and Python readers in
//! docs/registry-layout.md). Built on [`crate::shm`]; must not touch `ipc`, `driver` or tokens'
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

mod error;
pub mod inspect;
pub mod layout;
mod participant;
mod slot;

pub use error::RegistryError;
#[doc(hidden)]
pub use slot::{TestPoint, set_test_hook};

use crate::error::{Error, Result};
use crate::identity::{Liveness, ProcessIdentity};
use crate::shm::{Segment, SegmentOptions, ShmError, futex};
use crate::sync::{Ordering, fence};
use layout::*;
use participant::EntryState;
use slot::{SlotView, Taken, TestPoint as Point};
use std::time::{Duration, Instant};

/// Seqlock read attempts per slot before the reader checks on the writer.
const READ_RETRIES: u32 = 256;

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
    /// The record's sequence number: greater than every earlier number of this name.
    pub seq: u64,
    /// The slot index it sits in.
    pub slot: u32,
}

impl Record {
    /// Whether the publishing process still runs (see [`ProcessIdentity::liveness`]).
    pub fn owner_liveness(&self) -> Liveness {
        self.owner.liveness()
    }
}

/// What [`Registry::reclaim_dead`] freed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReclaimReport {
    /// Published records whose owner is dead, removed.
    pub records: u32,
    /// Half-written records of dead writers (or corrupt slots), dropped.
    pub half_written: u32,
    /// Participant entries of dead processes, freed.
    pub participants: u32,
    /// Records, locks and participant entries kept because whether their process runs could not be
    /// told ([`Liveness::Unknown`], e.g. another user's liveness file): never treated as dead.
    pub kept_unknown: u32,
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
}

fn corrupt(name: &str, what: String) -> Error {
    RegistryError::Corrupt {
        name: name.to_string(),
        what,
    }
    .into()
}

/// Checks a record name: 1 to 64 bytes of UTF-8 without control characters.
fn validate_record_name(name: &str) -> Result<()> {
    if name.is_empty() {
        return Err(RegistryError::InvalidName {
            name: String::new(),
            reason: "empty record name",
        }
        .into());
    }
    if name.len() > RECORD_NAME_MAX {
        return Err(RegistryError::TooLarge {
            what: "record name",
            len: name.len(),
            max: RECORD_NAME_MAX,
        }
        .into());
    }
    if name.chars().any(char::is_control) {
        return Err(RegistryError::InvalidName {
            name: name.to_string(),
            reason: "control characters are not allowed in a record name",
        }
        .into());
    }
    Ok(())
}

fn pack_bytes(words: &mut [u64], bytes: &[u8]) {
    for (w, chunk) in words.iter_mut().zip(bytes.chunks(8)) {
        let mut b = [0u8; 8];
        b[..chunk.len()].copy_from_slice(chunk);
        *w = u64::from_le_bytes(b);
    }
}

fn unpack_bytes(words: &[u64], len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(words.len() * 8);
    for w in words {
        out.extend_from_slice(&w.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Decodes a consistent payload copy: `Ok(None)` for a free slot, an error text for bad bytes.
fn decode(words: &[u64; PAYLOAD_WORDS], slot: u32) -> std::result::Result<Option<Record>, String> {
    let state = words[W_STATE] as u32;
    match state {
        STATE_FREE => return Ok(None),
        STATE_PUBLISHED => {}
        s => return Err(format!("slot {slot}: unknown state {s}")),
    }
    let kl = words[W_KIND_LENS];
    let kind = kl as u32;
    let name_len = ((kl >> 32) & 0xffff) as usize;
    let token_len = (kl >> 48) as usize;
    let meta_len = (words[W_META_LEN] & 0xffff) as usize;
    if name_len == 0 || name_len > RECORD_NAME_MAX {
        return Err(format!(
            "slot {slot}: record name length {name_len} (1 to {RECORD_NAME_MAX})"
        ));
    }
    if token_len > TOKEN_MAX {
        return Err(format!(
            "slot {slot}: token length {token_len} (at most {TOKEN_MAX})"
        ));
    }
    if meta_len > METADATA_MAX {
        return Err(format!(
            "slot {slot}: metadata length {meta_len} (at most {METADATA_MAX})"
        ));
    }
    let name = String::from_utf8(unpack_bytes(&words[W_NAME..W_TOKEN], name_len))
        .map_err(|_| format!("slot {slot}: record name is not UTF-8"))?;
    let mut owner = [0u64; 4];
    owner.copy_from_slice(&words[W_OWNER..W_NAME]);
    Ok(Some(Record {
        name,
        kind,
        token: unpack_bytes(&words[W_TOKEN..W_META], token_len),
        metadata: unpack_bytes(&words[W_META..W_RESERVED], meta_len),
        owner: ProcessIdentity::from_words(owner),
        seq: words[W_SEQ],
        slot,
    }))
}

fn encode(
    name: &str,
    kind: u32,
    token: &[u8],
    metadata: &[u8],
    owner: &ProcessIdentity,
    seq: u64,
) -> [u64; PAYLOAD_WORDS] {
    let mut w = [0u64; PAYLOAD_WORDS];
    w[W_STATE] = u64::from(STATE_PUBLISHED);
    w[W_SEQ] = seq;
    w[W_KIND_LENS] = u64::from(kind) | ((name.len() as u64) << 32) | ((token.len() as u64) << 48);
    w[W_META_LEN] = metadata.len() as u64;
    w[W_OWNER..W_NAME].copy_from_slice(&owner.to_words());
    pack_bytes(&mut w[W_NAME..W_TOKEN], name.as_bytes());
    pack_bytes(&mut w[W_TOKEN..W_META], token);
    pack_bytes(&mut w[W_META..W_RESERVED], metadata);
    w
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

/// Small pause in lock loops: spin first, then yield, then sleep briefly.
fn pause(i: u32) {
    if i < 16 {
        std::hint::spin_loop();
    } else if i < 256 {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(50));
    }
}

impl Registry {
    /// Creates the registry segment `name` with `opts`' capacity and mode, initialises it, and
    /// joins it as a participant.
    ///
    /// The pages are reserved up front (a full `/dev/shm` fails here). The header's init stamp is
    /// stored last, so openers never use a half-initialised segment.
    ///
    /// # Errors
    /// [`ShmError::InvalidName`], [`ShmError::AlreadyExists`], [`ShmError::NoSpace`],
    /// [`Error::InvalidArgument`] for a capacity out of range, [`Error::Os`] for failed calls.
    ///
    /// # Examples
    /// ```
    /// use cuda_ipc::registry::{Registry, RegistryOptions};
    /// let name = format!("cuda-ipc-doc-reg-{}", std::process::id());
    /// let reg = Registry::create(&name, &RegistryOptions::new().capacity(8))?;
    /// let seq = reg.publish("frames", 1, b"token bytes", b"meta")?;
    /// let rec = reg.get("frames")?.unwrap();
    /// assert_eq!((rec.seq, &rec.token[..]), (seq, &b"token bytes"[..]));
    /// Registry::unlink(&name)?;
    /// # Ok::<(), cuda_ipc::Error>(())
    /// ```
    pub fn create(name: &str, opts: &RegistryOptions) -> Result<Registry> {
        if opts.slots == 0 || opts.slots > MAX_SLOTS {
            return Err(Error::InvalidArgument(format!(
                "registry capacity {} (1 to {MAX_SLOTS})",
                opts.slots
            )));
        }
        if opts.participants == 0 || opts.participants > MAX_PARTICIPANTS {
            return Err(Error::InvalidArgument(format!(
                "registry participants {} (1 to {MAX_PARTICIPANTS})",
                opts.participants
            )));
        }
        let me = ProcessIdentity::current()?;
        let total = total_size(opts.participants, opts.slots);
        let seg = Segment::create(
            name,
            total,
            &SegmentOptions::new().group_access(opts.group_access),
        )?;
        let hdr = Self::header_of(&seg);
        // Relaxed stores: all published by the Release store of init_stamp below. The creator's
        // identity and the version go first, published early by the magic's Release store, so a
        // stale, half-initialised segment can be told from a slow creator's.
        me.store_words(&hdr.creator);
        hdr.layout_version.store(LAYOUT_VERSION, Ordering::Relaxed);
        hdr.generation
            .store(crate::shm::new_generation(), Ordering::Relaxed);
        // SYNC POINT creator: Release, pairs with the Acquire load of the magic in
        // `remove_if_stale`: whoever sees the magic sees the creator's identity and the version.
        hdr.magic.store(MAGIC, Ordering::Release);
        hdr.header_size.store(HEADER_SIZE as u32, Ordering::Relaxed);
        hdr.total_size.store(total as u64, Ordering::Relaxed);
        hdr.slot_size.store(SLOT_SIZE as u32, Ordering::Relaxed);
        hdr.slot_count.store(opts.slots, Ordering::Relaxed);
        hdr.participant_size
            .store(PARTICIPANT_SIZE as u32, Ordering::Relaxed);
        hdr.participant_count
            .store(opts.participants, Ordering::Relaxed);
        hdr.record_name_max
            .store(RECORD_NAME_MAX as u32, Ordering::Relaxed);
        hdr.token_max.store(TOKEN_MAX as u32, Ordering::Relaxed);
        hdr.metadata_max
            .store(METADATA_MAX as u32, Ordering::Relaxed);
        // Slots and participant entries are zero from ftruncate: free.
        // Release: pairs with the Acquire load of init_stamp in `open`; everything above is visible
        // to an opener that sees the stamp.
        hdr.init_stamp.store(INIT_STAMP, Ordering::Release);
        Self::attach(seg, opts.slots, opts.participants, me, opts)
    }

    /// Opens the existing registry `name`, validating everything it reads, and joins it.
    ///
    /// Waits up to `opts.init_timeout` for a creator that is still initialising. Dead participants'
    /// entries are freed on the way in.
    ///
    /// # Errors
    /// - [`ShmError::NotFound`]; [`ShmError::WrongOwner`] for another user's segment
    ///   (unless `group_access` and a shared group); [`ShmError::InsecureMode`] for a segment
    ///   others may open;
    /// - [`ShmError::NotASegment`] for a FIFO, directory, socket or device under the name,
    ///   [`Error::InvalidArgument`] for a symbolic link (never followed), [`ShmError::Sparse`]
    ///   for a file whose pages are not all backed (after the wait: a creator may be sizing it);
    /// - [`ShmError::TooSmall`] for a zero-size or truncated segment;
    /// - [`RegistryError::ForeignSegment`], [`RegistryError::VersionMismatch`] (naming both
    ///   versions), [`RegistryError::Corrupt`] for header fields that disagree;
    /// - [`RegistryError::Uninitialised`] when the init stamp did not appear in time;
    /// - [`RegistryError::TooManyParticipants`] when every entry is held by a live process.
    pub fn open(name: &str, opts: &RegistryOptions) -> Result<Registry> {
        let start = Instant::now();
        loop {
            match Self::try_open(name, opts.group_access) {
                Ok((seg, slots, participants)) => {
                    let me = ProcessIdentity::current()?;
                    return Self::attach(seg, slots, participants, me, opts);
                }
                Err(Retry::Fatal(e)) => return Err(e),
                Err(Retry::NotReady(e)) => {
                    let waited = start.elapsed();
                    if waited >= opts.init_timeout {
                        return Err(match e {
                            Error::Registry(RegistryError::Uninitialised { name, .. }) => {
                                RegistryError::Uninitialised { name, waited }.into()
                            }
                            e => e,
                        });
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
            }
        }
    }

    /// Opens the registry `name`, or creates it when there is none.
    ///
    /// A segment under the name is replaced only when it is provably this crate's own stale
    /// registry: a regular, fully backed file of our uid, with the registry magic and this layout
    /// version, never initialised (no init stamp after `opts.init_timeout`), whose recorded creator
    /// is dead by [`ProcessIdentity::liveness`]. Its inode is checked again just before it is
    /// unlinked. Everything else is reported and left as it is. A fully initialised segment whose
    /// participants all died is simply opened: their entries and locks are reclaimed as met.
    ///
    /// # Errors
    /// As [`Registry::create`] and [`Registry::open`]. What is never replaced and how it is reported:
    /// a FIFO, directory, socket or device: [`ShmError::NotASegment`]; a symbolic link:
    /// [`Error::InvalidArgument`]; another user's segment: [`ShmError::WrongOwner`]; a sparse
    /// file: [`ShmError::Sparse`]; an empty or short file: [`ShmError::TooSmall`]; a
    /// file without the magic: [`RegistryError::ForeignSegment`] (or
    /// [`RegistryError::Uninitialised`] when it is all zero: a creator killed before its first
    /// store cannot be told from one about to make it); another layout version, live creator or
    /// not: [`RegistryError::VersionMismatch`]; an uninitialised registry of a live creator:
    /// [`RegistryError::Uninitialised`]; one whose creator's liveness cannot be told:
    /// [`RegistryError::CreatorUnknown`].
    pub fn open_or_create(name: &str, opts: &RegistryOptions) -> Result<Registry> {
        for _ in 0..4 {
            match Self::create(name, opts) {
                Err(Error::Shm(ShmError::AlreadyExists { .. })) => {}
                other => return other,
            }
            match Self::open(name, opts) {
                Err(Error::Shm(ShmError::NotFound { .. })) => continue,
                Err(
                    e @ (Error::Registry(RegistryError::Uninitialised { .. })
                    | Error::Shm(ShmError::TooSmall { .. })),
                ) => match Self::remove_if_stale(name, e)? {
                    Stale::Removed(creator) => {
                        tracing::warn!(segment = name, creator = %creator, "removed a stale registry segment left by a crashed creator");
                        continue;
                    }
                    Stale::Changed => continue,
                },
                other => return other,
            }
        }
        Err(Error::Timeout {
            what: "registry segment creation (it kept disappearing or reappearing)",
            after: opts.init_timeout * 4,
        })
    }

    /// Unlinks `name` if it is provably our own stale registry (the rule in
    /// [`Registry::open_or_create`]); otherwise returns the error that says why not (`why` when
    /// nothing more precise is known).
    fn remove_if_stale(name: &str, why: Error) -> Result<Stale> {
        precheck(name)?;
        let seg = match Segment::open(name) {
            Ok(s) => s,
            Err(Error::Shm(ShmError::NotFound { .. })) => return Ok(Stale::Changed),
            Err(e) => return Err(e),
        };
        seg.check_owner()?;
        if seg.len() < HEADER_SIZE {
            return Err(ShmError::TooSmall {
                name: name.to_string(),
                len: seg.len() as u64,
                min: HEADER_SIZE as u64,
            }
            .into());
        }
        let hdr = Self::header_of(&seg);
        // SYNC POINT creator: Acquire, pairs with the creator's Release store of the magic; the
        // creator identity and version read below are the creator's.
        let magic = hdr.magic.load(Ordering::Acquire);
        if magic == 0 {
            // All zero so far: a creator killed before its first store looks exactly like one
            // about to make it. Not provably stale.
            return Err(why);
        }
        if magic != MAGIC {
            return Err(RegistryError::ForeignSegment {
                name: name.to_string(),
                found: magic,
            }
            .into());
        }
        // Relaxed: ordered by the Acquire load of the magic (SYNC POINT creator).
        let version = hdr.layout_version.load(Ordering::Relaxed);
        if version != LAYOUT_VERSION {
            return Err(RegistryError::VersionMismatch {
                name: name.to_string(),
                found: version,
                supported: LAYOUT_VERSION,
            }
            .into());
        }
        // Acquire: pairs with the creator's Release store of the stamp.
        if hdr.init_stamp.load(Ordering::Acquire) == INIT_STAMP {
            return Ok(Stale::Changed); // finished meanwhile: open it
        }
        let creator = ProcessIdentity::load_words(&hdr.creator);
        match creator.liveness() {
            Liveness::Dead => {}
            Liveness::Alive => return Err(why),
            _ => {
                return Err(RegistryError::CreatorUnknown {
                    name: name.to_string(),
                    creator: creator.to_string(),
                }
                .into());
            }
        }
        let ino = seg.inode()?;
        drop(seg);
        // Removed only while the name still stands for the segment judged, under a lock every
        // replacer takes on it: a fresh segment another opener made in between is left alone.
        if Segment::unlink_if_same(name, ino)? {
            Ok(Stale::Removed(creator))
        } else {
            Ok(Stale::Changed)
        }
    }

    /// Removes the registry's name (`shm_unlink`); handles already open keep working.
    ///
    /// # Errors
    /// As [`Segment::unlink`].
    pub fn unlink(name: &str) -> Result<()> {
        Segment::unlink(name)
    }

    fn try_open(name: &str, allow_group: bool) -> std::result::Result<(Segment, u32, u32), Retry> {
        let not_ready = |e: Error| match e {
            // A creator between `ftruncate` and `fallocate` (sparse) or before `ftruncate` (empty).
            Error::Shm(ShmError::TooSmall { .. } | ShmError::Sparse { .. }) => Retry::NotReady(e),
            e => Retry::Fatal(e),
        };
        precheck(name).map_err(not_ready)?;
        let seg = Segment::open(name).map_err(not_ready)?;
        seg.check_access(allow_group).map_err(Retry::Fatal)?;
        let len = seg.len();
        if len < HEADER_SIZE {
            return Err(Retry::NotReady(
                ShmError::TooSmall {
                    name: name.to_string(),
                    len: len as u64,
                    min: HEADER_SIZE as u64,
                }
                .into(),
            ));
        }
        let hdr = Self::header_of(&seg);
        // Acquire: pairs with the creator's Release store of the stamp; the fields read below are
        // then the creator's.
        let stamp = hdr.init_stamp.load(Ordering::Acquire);
        // Relaxed: ordered by the Acquire above when the stamp is set; otherwise only diagnostic.
        let magic = hdr.magic.load(Ordering::Relaxed);
        if magic != MAGIC && !(magic == 0 && stamp == 0) {
            return Err(Retry::Fatal(
                RegistryError::ForeignSegment {
                    name: name.to_string(),
                    found: magic,
                }
                .into(),
            ));
        }
        if stamp != INIT_STAMP {
            if stamp != 0 {
                return Err(Retry::Fatal(corrupt(
                    name,
                    format!("init stamp {stamp:#018x}, expected {INIT_STAMP:#018x} or 0"),
                )));
            }
            return Err(Retry::NotReady(
                RegistryError::Uninitialised {
                    name: name.to_string(),
                    waited: Duration::ZERO,
                }
                .into(),
            ));
        }
        let version = hdr.layout_version.load(Ordering::Relaxed);
        if version != LAYOUT_VERSION {
            return Err(Retry::Fatal(
                RegistryError::VersionMismatch {
                    name: name.to_string(),
                    found: version,
                    supported: LAYOUT_VERSION,
                }
                .into(),
            ));
        }
        let check = |what: &str, found: u64, expected: u64| {
            if found == expected {
                Ok(())
            } else {
                Err(Retry::Fatal(corrupt(
                    name,
                    format!("{what} is {found}, this layout has {expected}"),
                )))
            }
        };
        check(
            "header size",
            hdr.header_size.load(Ordering::Relaxed).into(),
            HEADER_SIZE as u64,
        )?;
        check(
            "slot size",
            hdr.slot_size.load(Ordering::Relaxed).into(),
            SLOT_SIZE as u64,
        )?;
        check(
            "participant entry size",
            hdr.participant_size.load(Ordering::Relaxed).into(),
            PARTICIPANT_SIZE as u64,
        )?;
        check(
            "record name maximum",
            hdr.record_name_max.load(Ordering::Relaxed).into(),
            RECORD_NAME_MAX as u64,
        )?;
        check(
            "token maximum",
            hdr.token_max.load(Ordering::Relaxed).into(),
            TOKEN_MAX as u64,
        )?;
        check(
            "metadata maximum",
            hdr.metadata_max.load(Ordering::Relaxed).into(),
            METADATA_MAX as u64,
        )?;
        let slots = hdr.slot_count.load(Ordering::Relaxed);
        let participants = hdr.participant_count.load(Ordering::Relaxed);
        if slots == 0 || slots > MAX_SLOTS {
            return Err(Retry::Fatal(corrupt(
                name,
                format!("slot count {slots} (1 to {MAX_SLOTS})"),
            )));
        }
        if participants == 0 || participants > MAX_PARTICIPANTS {
            return Err(Retry::Fatal(corrupt(
                name,
                format!("participant count {participants} (1 to {MAX_PARTICIPANTS})"),
            )));
        }
        let need = total_size(participants, slots) as u64;
        check(
            "total size in the header",
            hdr.total_size.load(Ordering::Relaxed),
            need,
        )?;
        if (len as u64) < need {
            return Err(Retry::Fatal(
                ShmError::TooSmall {
                    name: name.to_string(),
                    len: len as u64,
                    min: need,
                }
                .into(),
            ));
        }
        Ok((seg, slots, participants))
    }

    fn attach(
        seg: Segment,
        slots: u32,
        participants: u32,
        me: ProcessIdentity,
        opts: &RegistryOptions,
    ) -> Result<Registry> {
        if participant::owner_word(&me, 0).is_none() {
            return Err(Error::InvalidArgument(format!(
                "pid {} does not fit a registry participant entry (22 bits)",
                me.pid
            )));
        }
        let mut reg = Self::observer(seg, slots, participants, me)?;
        reg.lock_timeout = opts.lock_timeout;
        // Dead participants' entries are freed on the way in (as `open` promises), not only when
        // every entry is taken: a registry outlives crashed processes, and `participants()` should
        // not list them to the next one that joins.
        reg.reclaim_participants(&mut ReclaimReport::default());
        let (i, owner, name) = reg.claim_participant().ok_or_else(|| {
            Error::from(RegistryError::TooManyParticipants {
                name: reg.seg.name().to_string(),
                capacity: participants,
            })
        })?;
        reg.participant = i;
        reg.owner = owner;
        reg.lock_name = name;
        Ok(reg)
    }

    /// A handle that holds no participant entry (index out of range, so its drop frees none) and
    /// never takes a lock: for inspection, and the first step of [`Registry::attach`].
    fn observer(
        seg: Segment,
        slots: u32,
        participants: u32,
        me: ProcessIdentity,
    ) -> Result<Registry> {
        let st = rustix::fs::fstat(seg.fd())
            .map_err(|e| crate::error::OsError::new("fstat", format!("/{}", seg.name()), e))?;
        let file_id = (st.st_dev, st.st_ino);
        // Relaxed: written before the init stamp, which the opener loaded with Acquire.
        let generation = Self::header_of(&seg).generation.load(Ordering::Relaxed);
        Ok(Registry {
            seg,
            slots,
            participants,
            me,
            lock_name: 0,
            owner: 0,
            participant: u32::MAX,
            lock_timeout: Duration::ZERO,
            file_id,
            generation,
        })
    }

    /// Claims a free participant entry and seals it with this process's identity; returns its
    /// index, owner word and lock name.
    fn claim_participant(&self) -> Option<(u32, u64, u64)> {
        for i in 0..self.participants {
            let p = self.participant_at(i);
            // Relaxed: only a hint for which entry to try.
            if p.owner.load(Ordering::Relaxed) != 0 {
                continue;
            }
            // Relaxed: a read-modify-write, so every attempt on this entry gets its own number;
            // that keeps owner words and lock names of successive claims apart.
            let claim = p.claims.fetch_add(1, Ordering::Relaxed).wrapping_add(1);
            let owner = participant::owner_word(&self.me, claim)?;
            // Acquire on success: pairs with the Release that freed the entry (the holder's drop or
            // a reclaim), so the previous claim's stores come before ours.
            if p.owner
                .compare_exchange(0, owner, Ordering::Acquire, Ordering::Relaxed)
                .is_err()
            {
                continue;
            }
            // SYNC POINT claim: Release fence, pairs with the Acquire fence in `entry_state`: a
            // reader that copies any identity word below then sees this claim's owner word.
            fence(Ordering::Release);
            self.me.store_words(&p.identity);
            let name = participant::lock_name(claim, i);
            // SYNC POINT seal: Release, pairs with the Acquire load of `lock_name` in
            // `entry_state`; the identity above is complete for whoever sees this name.
            p.lock_name.store(name, Ordering::Release);
            return Some((i, owner, name));
        }
        None
    }

    /// Entry `i`, copied consistently.
    fn entry(&self, i: u32) -> EntryState {
        participant::entry_state(self.participant_at(i), i)
    }

    /// Whether the holder of lock name `name` runs, and who it is (see [`participant`]).
    fn holder_liveness(&self, name: u64) -> (Liveness, Option<ProcessIdentity>) {
        participant::holder_liveness(|i| self.entry(i), name, self.participants)
    }

    /// `true` only when the holder of lock name `name` is dead ([`Liveness::Unknown`] is not).
    fn holder_is_dead(&self, name: u64) -> bool {
        name != self.lock_name && self.holder_liveness(name).0 == Liveness::Dead
    }

    /// Whether the process behind entry `i` runs: the sealed identity decides, or for a claim that
    /// was never sealed, the claimer's pid and namespace.
    fn entry_liveness(&self, state: &EntryState) -> Liveness {
        match state {
            EntryState::Free => Liveness::Dead,
            EntryState::Held { identity, .. } => identity.liveness(),
            EntryState::Claiming { owner } => {
                participant::claimer_liveness(*owner, self.me.boot_id)
            }
            EntryState::Changing => Liveness::Unknown,
        }
    }

    /// Frees the entries of dead processes; counts those kept as unknown in `rep`.
    fn reclaim_participants(&self, rep: &mut ReclaimReport) -> u32 {
        let mut n = 0;
        for i in 0..self.participants {
            if i == self.participant {
                continue;
            }
            let state = self.entry(i);
            let owner = match state {
                EntryState::Held { owner, .. } | EntryState::Claiming { owner } => owner,
                EntryState::Free | EntryState::Changing => continue,
            };
            match self.entry_liveness(&state) {
                Liveness::Dead => {
                    let p = self.participant_at(i);
                    // Release: pairs with the next claimer's Acquire compare-exchange. The owner
                    // word carries the claim's generation, so a newer claim is never freed here.
                    if p.owner
                        .compare_exchange(owner, 0, Ordering::Release, Ordering::Relaxed)
                        .is_ok()
                    {
                        n += 1;
                    }
                }
                Liveness::Alive => {}
                _ => rep.kept_unknown += 1,
            }
        }
        n
    }

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
        debug_assert!(seg.len() >= HEADER_SIZE);
        // (1) The mapping is at least HEADER_SIZE bytes (checked by every caller) and lives as long
        // as `seg`, which the returned reference borrows; (2) it is page-aligned, so the Header's
        // 8-byte alignment holds; (3) Header consists only of atomics, so a shared reference to it
        // permits the concurrent writes of other processes and no plain byte is ever referenced.
        // SAFETY: (1)-(3) above; (4) every bit pattern is a valid atomic integer.
        unsafe { &*(seg.as_ptr() as *const Header) }
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

    fn notify(&self) {
        let h = self.header();
        // Release: pairs with the Acquire load in `wait_for`; a waiter that sees the new value also
        // sees the slot changes made before it.
        h.notify.fetch_add(1, Ordering::Release);
        // SeqCst fence: pairs with the waiter's SeqCst fence between its `waiters` increment and its
        // `notify` load (a store-load handshake): either we see its increment and wake it, or it sees
        // our new `notify` value and does not sleep. Skips the wake syscall when nobody waits.
        fence(Ordering::SeqCst);
        // Relaxed: ordered by the fence above.
        if h.waiters.load(Ordering::Relaxed) != 0 {
            futex::wake_all(&h.notify);
        }
    }

    /// Takes a slot's writer lock, taking it over from a dead holder. Bounded by the lock timeout.
    fn lock_slot(&self, i: u32) -> Result<Taken> {
        let v = self.view(i);
        let deadline = deadline_after(self.lock_timeout);
        let mut slow = SlowPath::new();
        let dead = |t: u64| self.holder_is_dead(t);
        let never = |_: u64| false;
        for n in 0u32.. {
            // Check liveness only now and then: it costs a few system calls.
            let check: &dyn Fn(u64) -> bool = if n % 64 == 63 { &dead } else { &never };
            if let Some(t) = v.try_lock(self.lock_name, check) {
                if matches!(t, Taken::Recovered { .. }) {
                    self.notify();
                }
                return Ok(t);
            }
            if n % 64 == 63 {
                if slow.due() {
                    self.check_superseded()?;
                }
                if Instant::now() >= deadline {
                    return Err(Error::Timeout {
                        what: "a registry slot's writer lock",
                        after: self.lock_timeout,
                    });
                }
            }
            pause(n);
        }
        unreachable!("the loop returns")
    }

    fn lock_table(&self) -> Result<()> {
        let w = &self.header().table_lock;
        let deadline = deadline_after(self.lock_timeout);
        let mut slow = SlowPath::new();
        for n in 0u32.. {
            // SYNC POINT holder: Acquire, pairs with the Release half of a holder's AcqRel
            // compare-exchange below, so the holder's sealed entry is visible to the check.
            let cur = w.load(Ordering::Acquire);
            let take_from = if cur == 0 {
                Some(0)
            } else if n % 64 == 63 && self.holder_is_dead(cur) {
                Some(cur)
            } else {
                None
            };
            if let Some(from) = take_from {
                // AcqRel: the Acquire half pairs with the Release in `unlock_table` by the
                // previous holder; the Release half with the Acquire load above (SYNC POINT holder).
                if w.compare_exchange(from, self.lock_name, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
                {
                    return Ok(());
                }
            }
            if n % 64 == 63 {
                if slow.due() {
                    self.check_superseded()?;
                }
                if Instant::now() >= deadline {
                    return Err(Error::Timeout {
                        what: "the registry's table lock",
                        after: self.lock_timeout,
                    });
                }
            }
            pause(n);
        }
        unreachable!("the loop returns")
    }

    fn unlock_table(&self) {
        // Release: pairs with the next locker's Acquire compare-exchange.
        let _ = self.header().table_lock.compare_exchange(
            self.lock_name,
            0,
            Ordering::Release,
            Ordering::Relaxed,
        );
    }

    /// Reads slot `i` consistently. A write left open by a dead writer is recovered (the slot is
    /// freed, `Ok(None)`); a live writer is waited for up to the lock timeout.
    fn read_slot(&self, i: u32) -> Result<Option<Record>> {
        let v = self.view(i);
        let mut buf = [0u64; PAYLOAD_WORDS];
        let deadline = deadline_after(self.lock_timeout);
        let mut slow = SlowPath::new();
        let mut next_liveness = Instant::now();
        loop {
            match v.read(&mut buf, READ_RETRIES) {
                Ok(_) => {
                    return decode(&buf, i).map_err(|what| corrupt(self.name(), what));
                }
                Err(stalled) => {
                    let holder = v.holder();
                    // The holder's liveness costs system calls: at most every millisecond.
                    let now = Instant::now();
                    let look = now >= next_liveness;
                    if look {
                        next_liveness = now + Duration::from_millis(1);
                    }
                    if self.lock_name != 0
                        && (holder == 0 || (look && self.holder_is_dead(holder)))
                        && let Some(t) = v.try_lock(self.lock_name, &|h| self.holder_is_dead(h))
                    {
                        v.unlock(self.lock_name);
                        if matches!(t, Taken::Recovered { .. }) {
                            self.notify();
                        }
                        continue;
                    }
                    if slow.due() {
                        self.check_superseded()?;
                    }
                    if now >= deadline {
                        return Err(stalled.into());
                    }
                    std::thread::sleep(Duration::from_micros(20));
                }
            }
        }
    }

    fn home(&self, name: &str) -> u32 {
        // FNV-1a: where a name's search starts; any slot may hold it.
        let mut h: u32 = 0x811c_9dc5;
        for b in name.bytes() {
            h = (h ^ u32::from(b)).wrapping_mul(0x0100_0193);
        }
        h % self.slots
    }

    fn find(&self, name: &str) -> Result<Option<Record>> {
        let h = self.home(name);
        for k in 0..self.slots {
            let i = (h + k) % self.slots;
            if let Some(r) = self.read_slot(i)?
                && r.name == name
            {
                return Ok(Some(r));
            }
        }
        Ok(None)
    }

    /// Publishes a new version of record `name`: `kind`, `token` (at most 256 bytes) and `metadata`
    /// (at most 128 bytes), owned by this process. Returns its sequence number, greater than every
    /// earlier number of this name. Wakes every waiter.
    ///
    /// # Errors
    /// [`RegistryError::InvalidName`] / [`RegistryError::TooLarge`] for bad arguments,
    /// [`RegistryError::Full`] when the name is new and no slot is free, [`Error::Timeout`] when a
    /// live process holds the lock longer than the lock timeout, [`RegistryError::Corrupt`] when a
    /// slot's bytes make no sense.
    pub fn publish(&self, name: &str, kind: u32, token: &[u8], metadata: &[u8]) -> Result<u64> {
        validate_record_name(name)?;
        if token.len() > TOKEN_MAX {
            return Err(RegistryError::TooLarge {
                what: "token",
                len: token.len(),
                max: TOKEN_MAX,
            }
            .into());
        }
        if metadata.len() > METADATA_MAX {
            return Err(RegistryError::TooLarge {
                what: "metadata",
                len: metadata.len(),
                max: METADATA_MAX,
            }
            .into());
        }
        loop {
            // Fast path: the name has a slot; update it under its lock.
            if let Some(r) = self.find(name)? {
                if let Some(seq) = self.update_slot(r.slot, name, false, kind, token, metadata)? {
                    return Ok(seq);
                }
                continue;
            }
            // New name: under the table lock, look again, then take a free slot.
            self.lock_table()?;
            let res = self.create_record(name, kind, token, metadata);
            self.unlock_table();
            match res? {
                Some(seq) => return Ok(seq),
                None => continue,
            }
        }
    }

    /// Under the table lock: `Some(seq)` once published, `None` when the name appeared meanwhile.
    fn create_record(
        &self,
        name: &str,
        kind: u32,
        token: &[u8],
        metadata: &[u8],
    ) -> Result<Option<u64>> {
        if self.find(name)?.is_some() {
            return Ok(None);
        }
        let h = self.home(name);
        for k in 0..self.slots {
            let i = (h + k) % self.slots;
            if self.read_slot(i)?.is_some() {
                continue;
            }
            if let Some(seq) = self.update_slot(i, name, true, kind, token, metadata)? {
                return Ok(Some(seq));
            }
        }
        Err(RegistryError::Full {
            name: self.name().to_string(),
            capacity: self.slots,
        }
        .into())
    }

    /// Locks slot `i`, checks it is free (`new`) or still holds `name` (not `new`), and writes the
    /// record. `Ok(None)` when the check failed (the caller looks again).
    fn update_slot(
        &self,
        i: u32,
        name: &str,
        new: bool,
        kind: u32,
        token: &[u8],
        metadata: &[u8],
    ) -> Result<Option<u64>> {
        self.lock_slot(i)?;
        let v = self.view(i);
        let mut buf = [0u64; PAYLOAD_WORDS];
        // We hold the lock and any write left open was repaired while taking it, so the first
        // attempt succeeds unless the bytes are corrupt.
        let cur = v
            .read(&mut buf, 4)
            .map_err(Error::from)
            .and_then(|_| decode(&buf, i).map_err(|what| corrupt(self.name(), what)));
        let fits = match &cur {
            Ok(None) => new,
            Ok(Some(r)) => !new && r.name == name,
            Err(_) => false,
        };
        if !fits {
            v.unlock(self.lock_name);
            return cur.map(|_| None);
        }
        // Relaxed: a read-modify-write of one location is totally ordered, and it runs under the
        // slot lock, so successive writers of a slot take increasing numbers.
        let prev = self.header().next_seq.fetch_add(1, Ordering::Relaxed);
        if prev >= u64::MAX / 2 {
            // No registry counts this far (2^63 publishes); only corrupt bytes get here.
            v.unlock(self.lock_name);
            return Err(corrupt(
                self.name(),
                format!("sequence counter at {prev}, beyond any real count"),
            ));
        }
        let seq = prev + 1;
        let words = encode(name, kind, token, metadata, &self.me, seq);
        match v.lock.try_write() {
            Some(w) => {
                for (k, x) in words.iter().enumerate() {
                    w.store(k, *x);
                    if k == PAYLOAD_WORDS / 2 {
                        slot::test_point(Point::WriteHalfStored);
                    }
                }
                w.finish();
            }
            None => {
                v.unlock(self.lock_name);
                return Err(corrupt(
                    self.name(),
                    format!("slot {i}: sequence odd under its writer lock"),
                ));
            }
        }
        v.unlock(self.lock_name);
        self.notify();
        Ok(Some(seq))
    }

    /// The current record `name`, or `None` when there is none. Never returns a torn record.
    ///
    /// # Errors
    /// [`RegistryError::InvalidName`] / [`RegistryError::TooLarge`] for a bad name,
    /// [`ShmError::WriterStalled`] when a live writer held a slot open for the whole lock
    /// timeout, [`RegistryError::Corrupt`] for nonsensical slot bytes.
    pub fn get(&self, name: &str) -> Result<Option<Record>> {
        validate_record_name(name)?;
        self.find(name)
    }

    /// Waits until record `name` has a sequence number greater than `after_seq`, at most `timeout`.
    ///
    /// Sleeps on the registry's shared futex word, re-checking after every wake-up and at least
    /// every 100 ms (a publisher may die between publishing and waking). `after_seq = 0` waits for
    /// any record of that name. `timeout`: how long to wait at most (`Duration::MAX` is fine).
    ///
    /// # Errors
    /// [`Error::Timeout`] when nothing newer arrived in time; [`RegistryError::Superseded`] within
    /// about 0.5 s once another segment has the registry's name (the name was removed and made
    /// again: open it again); the errors of [`Registry::get`].
    pub fn wait_for(&self, name: &str, after_seq: u64, timeout: Duration) -> Result<Record> {
        validate_record_name(name)?;
        let deadline = deadline_after(timeout);
        let word = &self.header().notify;
        let mut slow = SlowPath::new();
        loop {
            // Acquire: pairs with the publisher's Release fetch_add in `notify`.
            let v = word.load(Ordering::Acquire);
            if let Some(r) = self.find(name)?
                && r.seq > after_seq
            {
                return Ok(r);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout {
                    what: "a newer registry record",
                    after: timeout,
                });
            }
            let waiters = &self.header().waiters;
            // Relaxed increment, then a SeqCst fence: pairs with the publisher's SeqCst fence in
            // `notify`. A waiter that died asleep leaves the count high, which only costs publishers
            // a wake call.
            waiters.fetch_add(1, Ordering::Relaxed);
            fence(Ordering::SeqCst);
            // Relaxed: ordered after the increment by the fence; the kernel compares it again.
            if word.load(Ordering::Relaxed) == v {
                futex::wait(word, v, (deadline - now).min(Duration::from_millis(100)));
            }
            waiters.fetch_sub(1, Ordering::Relaxed);
            // Slow path only (at most every 250 ms, after a sleep): has the name been given to
            // another segment? Then nobody publishes here any more.
            if slow.due() {
                self.check_superseded()?;
            }
        }
    }

    /// Every published record, in slot order. Never returns a torn record.
    ///
    /// # Errors
    /// As [`Registry::get`].
    pub fn list(&self) -> Result<Vec<Record>> {
        let mut out = Vec::new();
        for i in 0..self.slots {
            if let Some(r) = self.read_slot(i)? {
                out.push(r);
            }
        }
        Ok(out)
    }

    /// Removes record `name`; `true` when there was one. Its sequence numbers are not reused.
    ///
    /// # Errors
    /// As [`Registry::get`], and [`Error::Timeout`] when a live process holds the slot's lock.
    pub fn remove(&self, name: &str) -> Result<bool> {
        validate_record_name(name)?;
        loop {
            let Some(r) = self.find(name)? else {
                return Ok(false);
            };
            if self.free_slot_if(r.slot, |cur| cur.name == name, false)? {
                return Ok(true);
            }
        }
    }

    /// Locks slot `i`; when it holds a record for which `pred` is true (or corrupt bytes and
    /// `free_corrupt`), frees it. Returns whether it freed it.
    fn free_slot_if(
        &self,
        i: u32,
        pred: impl Fn(&Record) -> bool,
        free_corrupt: bool,
    ) -> Result<bool> {
        self.lock_slot(i)?;
        let v = self.view(i);
        let mut buf = [0u64; PAYLOAD_WORDS];
        let cur = v
            .read(&mut buf, 4)
            .map_err(Error::from)
            .and_then(|_| decode(&buf, i).map_err(|what| corrupt(self.name(), what)));
        let doit = matches!(&cur, Ok(Some(r)) if pred(r)) || (cur.is_err() && free_corrupt);
        if doit && let Some(w) = v.lock.try_write() {
            for k in 0..PAYLOAD_WORDS {
                w.store(k, 0);
            }
            w.finish();
        }
        v.unlock(self.lock_name);
        if doit {
            self.notify();
        }
        match cur {
            Err(e) if !doit => Err(e),
            _ => Ok(doit),
        }
    }

    /// Frees what dead processes left: their published records, writes they left open, slots whose
    /// bytes are corrupt, and their participant entries. A process is dead only when
    /// [`ProcessIdentity::liveness`] says [`Liveness::Dead`]; what belongs to a process whose
    /// liveness is unknown is kept and counted in [`ReclaimReport::kept_unknown`].
    ///
    /// A slot whose write a live writer keeps open for the whole lock timeout is skipped.
    ///
    /// # Errors
    /// [`Error::Timeout`] when a live process holds a slot's lock for the whole lock timeout while
    /// a dead owner's record there is to be freed; [`RegistryError::Superseded`] when the name was
    /// given to another segment meanwhile.
    pub fn reclaim_dead(&self) -> Result<ReclaimReport> {
        let mut rep = ReclaimReport::default();
        rep.participants = self.reclaim_participants(&mut rep);
        for i in 0..self.slots {
            let v = self.view(i);
            let holder = v.holder();
            if holder != 0 && holder != self.lock_name {
                match self.holder_liveness(holder).0 {
                    Liveness::Dead => {
                        if let Some(Taken::Recovered { dropped_record }) =
                            v.try_lock(self.lock_name, &|h| self.holder_is_dead(h))
                        {
                            v.unlock(self.lock_name);
                            if dropped_record {
                                rep.half_written += 1;
                            }
                            self.notify();
                        }
                    }
                    Liveness::Alive => {}
                    _ => rep.kept_unknown += 1,
                }
            }
            match self.read_slot(i) {
                Ok(Some(r)) => match r.owner.liveness() {
                    Liveness::Dead => {
                        if self.free_slot_if(i, |cur| cur.seq == r.seq, false)? {
                            rep.records += 1;
                        }
                    }
                    Liveness::Alive => {}
                    _ => rep.kept_unknown += 1,
                },
                Ok(None) => {}
                Err(Error::Registry(RegistryError::Corrupt { .. })) => {
                    if self.free_slot_if(i, |_| false, true)? {
                        rep.half_written += 1;
                    }
                }
                // A write held open by a live (or unknown) writer for the whole lock timeout: not
                // ours to free.
                Err(Error::Shm(ShmError::WriterStalled { .. })) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(rep)
    }

    /// Live participants (processes with this registry open), from the participant table: every
    /// sealed entry whose identity is not [`Liveness::Dead`], each process once.
    pub fn participants(&self) -> Vec<ProcessIdentity> {
        let mut out = Vec::new();
        for i in 0..self.participants {
            if let EntryState::Held { identity, .. } = self.entry(i)
                && identity.liveness() != Liveness::Dead
                && !out.contains(&identity)
            {
                out.push(identity);
            }
        }
        out
    }
}

/// Whether `open` should wait and try again.
enum Retry {
    NotReady(Error),
    Fatal(Error),
}

/// What [`Registry::remove_if_stale`] did.
enum Stale {
    /// Unlinked: a never-initialised registry of this crate whose creator (named) is dead.
    Removed(ProcessIdentity),
    /// The name changed meanwhile (gone, finished, or another object): look again.
    Changed,
}

/// What a file type is, in the words of [`ShmError::NotASegment`].
fn kind_of(ft: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if ft.is_dir() {
        "directory"
    } else if ft.is_fifo() {
        "FIFO"
    } else if ft.is_socket() {
        "socket"
    } else if ft.is_char_device() {
        "character device"
    } else if ft.is_block_device() {
        "block device"
    } else if ft.is_symlink() {
        "symbolic link"
    } else {
        "special file"
    }
}

/// Refuses, before anything is opened, what a registry name cannot stand for: a FIFO, directory,
/// socket or device ([`ShmError::NotASegment`]) or a sparse file ([`ShmError::Sparse`]:
/// touching its holes could raise `SIGBUS`). Only `lstat`, so nothing blocks and no link is
/// followed; symbolic links and missing names are left to [`Segment::open`], which refuses or
/// reports them. [`Segment::open`] checks the opened descriptor the same way, so a swap after this
/// look is caught there.
fn precheck(name: &str) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    crate::shm::validate_name(name)?;
    let path = format!("{}/{name}", crate::shm::SHM_DIR);
    let Ok(m) = std::fs::symlink_metadata(&path) else {
        return Ok(());
    };
    let ft = m.file_type();
    if ft.is_symlink() {
        return Ok(());
    }
    if !ft.is_file() {
        return Err(ShmError::NotASegment {
            name: name.to_string(),
            kind: kind_of(ft),
        }
        .into());
    }
    let backed = m.blocks().saturating_mul(512);
    if backed < m.size() {
        return Err(ShmError::Sparse {
            name: name.to_string(),
            len: m.size(),
            backed,
        }
        .into());
    }
    Ok(())
}

impl Drop for Registry {
    fn drop(&mut self) {
        if self.participant < self.participants {
            let p = self.participant_at(self.participant);
            // Release: pairs with the next claimer's Acquire compare-exchange.
            let _ = p
                .owner
                .compare_exchange(self.owner, 0, Ordering::Release, Ordering::Relaxed);
        }
    }
}
