//! Creating, opening and joining a registry segment, and removing a stale one: the versioned
//! segment protocol (`shm::versioned`) for the registry's layout, and the registry's own
//! checks of its header (sizes, counts) and its own judgement of a stale segment.

use super::layout::*;
use super::participant;
use super::{ReclaimReport, Registry, RegistryError, RegistryOptions, corrupt};
use crate::error::{Error, Result};
use crate::identity::{Liveness, ProcessIdentity};
use crate::shm::versioned::{
    self, Blocker, Creator, HeaderError, Look, StampWord, VersionedHeader,
};
use crate::shm::{Segment, SegmentOptions, ShmError};
use crate::sync::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

// SAFETY: (1) the registry `Header` is `#[repr(C)]` and all atomics (`super::layout`); (2) its
// alignment is 8 (asserted there); (3) it is `HEADER_SIZE` bytes (asserted there).
unsafe impl VersionedHeader for Header {
    const MAGIC: u64 = MAGIC;
    const VERSION: u32 = LAYOUT_VERSION;
    const HEADER_LEN: usize = HEADER_SIZE;
    // A stamp word that is neither 0 nor INITDONE has always been refused as corrupt at once.
    const STRICT_STAMP: bool = true;

    fn magic(&self) -> &AtomicU64 {
        &self.magic
    }
    fn version(&self) -> &AtomicU32 {
        &self.layout_version
    }
    fn stamp(&self) -> StampWord<'_> {
        StampWord::U64(&self.init_stamp, INIT_STAMP)
    }
    fn generation(&self) -> &AtomicU64 {
        &self.generation
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
        // The protocol's order (`write_versioned`): the creator's identity, the generation and the
        // version first, published early by the magic's Release store (SYNC POINT creator, paired
        // with the Acquire load of the magic in `remove_if_stale`), so a stale, half-initialised
        // segment can be told from a slow creator's; then the fields below (Relaxed); then
        // init_stamp last with Release (paired with the Acquire load of init_stamp in `open`'s
        // look): everything is visible to an opener that sees the stamp.
        versioned::write_versioned::<Header>(
            &seg,
            |hdr| {
                me.store_words(&hdr.creator);
                // Relaxed: published with the identity by the magic's Release (SYNC POINT
                // creator).
                hdr.creator_uid.store(own_uid(), Ordering::Relaxed);
            },
            |hdr| {
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
            },
        );
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
    ///   versions), [`RegistryError::Corrupt`] for header fields that disagree, and for an init
    ///   stamp still 0 after `opts.init_timeout` though the creator it records runs and had
    ///   recorded itself at least 500 ms before the wait ended (a header overwritten since its
    ///   creation, not a creation in progress: a creator stamps within milliseconds of recording
    ///   itself);
    /// - [`RegistryError::Uninitialised`] when the init stamp did not appear in time otherwise;
    /// - [`RegistryError::TooManyParticipants`] when every entry is held by a live process.
    pub fn open(name: &str, opts: &RegistryOptions) -> Result<Registry> {
        let start = Instant::now();
        // The creator recorded in a segment found without its stamp, judged while it is awaited:
        // a stamp still 0 at the end under one that ran, recorded, for `versioned::STAMP_DUE` is
        // a header overwritten, not a creation in progress (the versioned protocol's one rule).
        let mut stamp_wait = versioned::StampWait::new();
        loop {
            match Self::try_open(name, opts.group_access) {
                Ok((seg, slots, participants)) => {
                    let me = ProcessIdentity::current()?;
                    return Self::attach(seg, slots, participants, me, opts);
                }
                Err(Retry::Fatal(e)) => return Err(e),
                Err(Retry::NotReady(e)) => {
                    let waited = start.elapsed();
                    let over = waited >= opts.init_timeout;
                    let unstamped =
                        matches!(e, Error::Registry(RegistryError::Uninitialised { .. }));
                    if unstamped && (over || stamp_wait.due()) {
                        stamp_wait.judged(creator_at(name));
                    }
                    if over {
                        return Err(match e {
                            Error::Registry(RegistryError::Uninitialised { name, .. }) => {
                                match stamp_wait.verdict(waited) {
                                    HeaderError::Overwritten { .. } => corrupt(
                                        &name,
                                        format!(
                                            "init stamp 0 after waiting {} ms though the \
                                             creator it records runs (a creation stamps within \
                                             milliseconds of recording its creator): the header \
                                             was overwritten, or its creator is stopped",
                                            waited.as_millis()
                                        ),
                                    ),
                                    _ => RegistryError::Uninitialised { name, waited }.into(),
                                }
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
    /// A segment under the name is replaced only when it is a creation abandoned half-way: a
    /// regular file of our uid, giving other users no access, that has the registry magic and
    /// this layout version but no init stamp after `opts.init_timeout`, and whose recorded
    /// creator is dead by [`ProcessIdentity::liveness_as`] with the recorded uid (the rule
    /// `cuda-ipc gc` removes one by, [`super::inspect::abandoned`]). Its inode is checked again
    /// just before it is unlinked. A file without the magic (empty, sparse, or zero where the
    /// magic goes) at least 2 s old is never replaced: nothing in it shows that a cuda-ipc
    /// creation made it rather than another program ([`RegistryError::NoMagic`]).
    /// Everything else is reported and left as it is. A fully initialised segment whose
    /// participants all died is simply opened: their entries and locks are reclaimed as met.
    ///
    /// # Errors
    /// As [`Registry::create`] and [`Registry::open`]. What is never replaced and how it is reported:
    /// a FIFO, directory, socket or device: [`ShmError::NotASegment`]; a symbolic link:
    /// [`Error::InvalidArgument`]; another user's segment: [`ShmError::WrongOwner`]; one open to
    /// other users (any of the mode bits `0o007`): [`ShmError::InsecureMode`]; a sparse
    /// file younger than the grace: [`ShmError::Sparse`]; an empty one as young, or a short file
    /// whose pages are there: [`ShmError::TooSmall`]; a file without the magic:
    /// [`RegistryError::ForeignSegment`] (or [`RegistryError::Uninitialised`] when it is all zero
    /// and younger than the grace); another layout version, live creator or not:
    /// [`RegistryError::VersionMismatch`]; an uninitialised registry of a live creator:
    /// [`RegistryError::Uninitialised`], or [`RegistryError::Corrupt`] when that creator had
    /// recorded itself at least 500 ms before the wait ended (its stamp zeroed, as
    /// [`Registry::open`] says); one whose creator's liveness cannot be told:
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
                    | Error::Shm(ShmError::TooSmall { .. })
                    | Error::Shm(ShmError::Sparse { .. })),
                ) => match Self::remove_if_stale(name, e)? {
                    Stale::Removed(why, creator) => {
                        let creator =
                            creator.map_or_else(|| "unknown".to_string(), |c| c.to_string());
                        tracing::warn!(segment = name, creator = %creator, "removed a stale registry segment: {why}");
                        continue;
                    }
                    Stale::Changed => continue,
                },
                other => return other,
            }
        }
        Err(Error::Timeout {
            what: "registry segment creation (it kept disappearing or reappearing)",
            after: opts.init_timeout.saturating_mul(4),
        })
    }

    /// Unlinks `name` if it is provably our own stale registry (the rule of [`judge_leftover`]);
    /// otherwise returns the error that says why not (`why` when nothing more precise is known).
    fn remove_if_stale(name: &str, why: Error) -> Result<Stale> {
        match judge_leftover(name)? {
            Leftover::Abandoned {
                why,
                inode,
                creator,
            } => {
                // Removed only while the name still stands for the segment judged, under a lock
                // every replacer takes on it: a fresh segment another opener made in between is
                // left alone.
                if Segment::unlink_if_same(name, inode)? {
                    Ok(Stale::Removed(why, creator))
                } else {
                    Ok(Stale::Changed)
                }
            }
            Leftover::Changed => Ok(Stale::Changed),
            // A creator may still finish it: the error the caller met says what it found.
            Leftover::UnderWay(_) => Err(why),
        }
    }

    /// Removes the registry's name (`shm_unlink`); handles already open keep working.
    ///
    /// # Errors
    /// As [`Segment::unlink`].
    pub fn unlink(name: &str) -> Result<()> {
        Segment::unlink(name)
    }

    pub(super) fn try_open(
        name: &str,
        allow_group: bool,
    ) -> std::result::Result<(Segment, u32, u32), Retry> {
        let not_ready = |e: Error| match e {
            // A creator between `ftruncate` and `fallocate` (sparse) or before `ftruncate`
            // (empty), waited for; but not a file this process may not open (refused by whose it
            // is), nor an empty or sparse one at least 2 s old without its creator's sizing lock
            // (abandoned: said at once).
            Error::Shm(ShmError::TooSmall { .. } | ShmError::Sparse { .. }) => {
                match Segment::stat(name) {
                    Ok(i) => match i.may_open(name, allow_group) {
                        Err(denied) => Retry::Fatal(denied),
                        Ok(()) if versioned::abandoned_creation(&i) => Retry::Fatal(e),
                        Ok(()) => Retry::NotReady(e),
                    },
                    Err(_) => Retry::NotReady(e),
                }
            }
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
        // One look (`versioned::look`): init_stamp Acquire, pairing with the creator's Release
        // store of the stamp, so the fields read below are then the creator's; the magic (a
        // foreign one refused at once) and the version. This layout's stamp is strict: a stamp
        // word that is neither 0 nor INITDONE is corrupt, not awaited.
        match versioned::look(hdr) {
            Look::Ready => {}
            // (`look` refuses none for a missing stamp: those three are the waits' own.)
            Look::Unstamped
            | Look::Refused(
                HeaderError::Unstamped { .. }
                | HeaderError::Abandoned
                | HeaderError::InUse
                | HeaderError::Overwritten { .. },
            ) => {
                return Err(Retry::NotReady(
                    RegistryError::Uninitialised {
                        name: name.to_string(),
                        waited: Duration::ZERO,
                    }
                    .into(),
                ));
            }
            Look::Refused(HeaderError::Foreign { magic }) => {
                return Err(Retry::Fatal(
                    RegistryError::ForeignSegment {
                        name: name.to_string(),
                        found: magic,
                    }
                    .into(),
                ));
            }
            Look::Refused(HeaderError::BadStamp { found: stamp }) => {
                return Err(Retry::Fatal(corrupt(
                    name,
                    format!("init stamp {stamp:#018x}, expected {INIT_STAMP:#018x} or 0"),
                )));
            }
            Look::Refused(HeaderError::OtherVersion { found }) => {
                return Err(Retry::Fatal(
                    RegistryError::VersionMismatch {
                        name: name.to_string(),
                        found,
                        supported: LAYOUT_VERSION,
                    }
                    .into(),
                ));
            }
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

    pub(super) fn attach(
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
        let mut freed = Vec::new();
        reg.reclaim_participants(&mut ReclaimReport::default(), &mut freed);
        reg.freed_on_join = freed;
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
    pub(super) fn observer(
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
            uid: own_uid(),
            lock_name: 0,
            owner: 0,
            participant: u32::MAX,
            lock_timeout: Duration::ZERO,
            file_id,
            generation,
            freed_on_join: Vec::new(),
            fork: crate::identity::ForkEpoch::now(),
        })
    }
}

/// Whether the registry segment `seg` (at least [`HEADER_SIZE`] bytes) shows use that only follows
/// its stamp: a sequence number drawn (`next_seq`, 0 at creation) or a participant entry whose
/// `owner` word is not 0 (entries are zero from `ftruncate` until a participant claims one, which
/// it does only in a stamped registry). Reads the entries the mapping holds, at most
/// [`MAX_PARTICIPANTS`], whatever the header's counts say.
fn used_since_stamped(seg: &Segment) -> bool {
    let hdr = Registry::header_of(seg);
    // Relaxed: a look at a word only; nothing else is read through it.
    if hdr.next_seq.load(Ordering::Relaxed) != 0 {
        return true;
    }
    let entries = (seg.len().saturating_sub(PARTICIPANTS_OFFSET) / PARTICIPANT_SIZE)
        .min(MAX_PARTICIPANTS as usize);
    (0..entries).any(|i| {
        // SAFETY: (1) entry `i` lies within the mapping (`i < entries`, counted from the
        // mapping's own length), which `seg` keeps alive; (2) `PARTICIPANTS_OFFSET + 64 i` is
        // 8-byte aligned in a page-aligned mapping; (3) `Participant` is all atomics, so other
        // processes' concurrent writes are permitted and no plain byte is referenced; (4) any
        // bit pattern is a valid atomic integer.
        let entry = unsafe {
            &*(seg.as_ptr().add(PARTICIPANTS_OFFSET + i * PARTICIPANT_SIZE) as *const Participant)
        };
        // Relaxed: a look at a word only, as above.
        entry.owner.load(Ordering::Relaxed) != 0
    })
}

/// This process's effective uid: what the registry records beside each identity it writes.
fn own_uid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// The creator that the registry segment `name`, found without its stamp, records, by the rule
/// of [`Creator::judged`]: none before the magic (whose Release store publishes the creator's
/// identity) or with pid 0, dead, or running (or whose liveness cannot be told). A segment that
/// cannot be mapped records none.
fn creator_at(name: &str) -> Creator {
    let Ok(seg) = Segment::open_with_min_len(name, HEADER_SIZE) else {
        return Creator::Unrecorded;
    };
    let hdr = Registry::header_of(&seg);
    // SYNC POINT creator: Acquire, pairs with the creator's Release store of the magic; the
    // identity read below is the creator's.
    if hdr.magic.load(Ordering::Acquire) != MAGIC {
        return Creator::Unrecorded;
    }
    // Relaxed: ordered by the Acquire load of the magic (SYNC POINT creator).
    let creator = ProcessIdentity::load_words(&hdr.creator);
    let uid = hdr.creator_uid.load(Ordering::Relaxed);
    Creator::judged(
        creator.pid != 0,
        || creator.liveness_as(uid) == Liveness::Dead,
        // Only the opener's wait asks (`StampWait`); a registry in use is told apart where one
        // is judged for removal (`judge_leftover`: `used_since_stamped`).
        || false,
    )
}

/// Whether `open` should wait and try again.
pub(super) enum Retry {
    NotReady(Error),
    Fatal(Error),
}

/// What [`Registry::remove_if_stale`] did.
enum Stale {
    /// Unlinked, for the reason given: a creation abandoned before its pages or header were
    /// written (no creator recorded), or a never-stamped registry whose creator (named) is dead.
    Removed(&'static str, Option<ProcessIdentity>),
    /// The name changed meanwhile (gone, finished, or another object): look again.
    Changed,
}

/// What [`judge_leftover`] found under a registry name.
#[derive(Debug)]
pub(super) enum Leftover {
    /// A leftover this user may remove: `why` says what it is, `inode` is the object judged
    /// (remove it only while the name still stands for it: [`Segment::unlink_if_same`]), `creator`
    /// the dead creator when one was recorded.
    Abandoned {
        why: &'static str,
        inode: u64,
        creator: Option<ProcessIdentity>,
    },
    /// The name changed meanwhile (gone, or finished initialising): look again.
    Changed,
    /// A creation that may still be finished (young, or its creator runs): why, in words
    /// ([`versioned::Creation::UnderWay`]'s).
    UnderWay(String),
}

/// The judgement of a registry segment that is not (yet) a usable registry, by the rule
/// [`Registry::open_or_create`] (which then replaces it) and `gc` ([`super::inspect::abandoned`],
/// which removes it) both follow. A registry's name is any name, and another program's file may stand
/// under it (a `multiprocessing.shared_memory` segment is sparse, its first bytes often zero):
/// only a file that records its creator is ever a leftover. Only this user's own segment, and of
/// those only one with the registry magic and this layout version, never stamped, whose recorded
/// creator is dead by [`ProcessIdentity::liveness_as`] with the recorded uid (at any age: a dead
/// creator never finishes). An empty, sparse or zero-header file at least
/// [`versioned::ABANDONED_AFTER`] old ([`versioned::stat_blocker`]) is [`RegistryError::NoMagic`],
/// left as it is, though a creator killed before its first store leaves one too (its name is
/// then blocked until someone who knows no program uses the file removes it).
///
/// A young creation or a live creator's is [`Leftover::UnderWay`], saying which.
///
/// # Errors
/// What is not a leftover, and why: [`ShmError::WrongOwner`] for another user's segment,
/// [`ShmError::InsecureMode`] for one open to other users (any of the mode bits `0o007`),
/// [`ShmError::NotASegment`] / [`Error::InvalidArgument`] for what is not a file,
/// [`ShmError::TooSmall`] for a short file whose pages are there (no creation of ours),
/// [`RegistryError::NoMagic`] for an old empty, sparse or zero-header file,
/// [`RegistryError::ForeignSegment`], [`RegistryError::VersionMismatch`] (naming both versions),
/// [`RegistryError::CreatorUnknown`] when the creator's liveness cannot be told;
/// [`RegistryError::Corrupt`] for an unstamped one of a dead creator that shows use, which only
/// follows the stamp (a participant's entry claimed, a sequence number drawn): a registry in use
/// whose header was overwritten, never removed.
pub(super) fn judge_leftover(name: &str) -> Result<Leftover> {
    crate::shm::validate_name(name)?;
    let judged = match Segment::stat(name) {
        Ok(info) => info,
        Err(Error::Shm(ShmError::NotFound { .. })) => return Ok(Leftover::Changed),
        Err(e) => return Err(e),
    };
    // An old file without the magic: the creator's to replace, never the cleaner's to remove.
    let unproven = |what: &'static str| -> Result<Leftover> {
        Err(RegistryError::NoMagic {
            name: name.to_string(),
            what,
        }
        .into())
    };
    match versioned::stat_blocker(name, HEADER_SIZE) {
        Ok(Blocker::Abandoned) => {
            return unproven(if judged.len == 0 { "empty" } else { "sparse" });
        }
        Ok(Blocker::Young) => {
            return Ok(Leftover::UnderWay(versioned::UNDER_WAY_UNSIZED.to_string()));
        }
        Ok(Blocker::Sized(_)) => {}
        Err(Error::Shm(ShmError::NotFound { .. })) => return Ok(Leftover::Changed),
        Err(e) => return Err(e),
    }
    let seg = match Segment::open_with_min_len(name, HEADER_SIZE) {
        Ok(s) => s,
        Err(Error::Shm(ShmError::NotFound { .. })) => return Ok(Leftover::Changed),
        Err(e) => return Err(e),
    };
    seg.check_owner()?;
    let inode = seg.inode()?;
    if inode != judged.inode {
        return Ok(Leftover::Changed);
    }
    let hdr = Registry::header_of(&seg);
    // SYNC POINT creator: Acquire, pairs with the creator's Release store of the magic; the
    // creator identity and version read below are the creator's.
    let magic = hdr.magic.load(Ordering::Acquire);
    if magic == 0 {
        // Pages reserved, header not begun: a live creator stores its magic microseconds after
        // `fallocate`. Only an old one is abandoned; no creator is recorded yet.
        if judged.age_secs >= versioned::ABANDONED_AFTER.as_secs() {
            return unproven("zero where the magic goes");
        }
        return Ok(Leftover::UnderWay(
            versioned::UNDER_WAY_UNSTAMPED.to_string(),
        ));
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
        return Ok(Leftover::Changed); // finished meanwhile: open it
    }
    // Relaxed: ordered by the Acquire load of the magic (SYNC POINT creator).
    let creator = ProcessIdentity::load_words(&hdr.creator);
    let creator_uid = hdr.creator_uid.load(Ordering::Relaxed);
    match creator.liveness_as(creator_uid) {
        // A creation never gets that far: participants join and records are published only in a
        // stamped registry, so this is one in use whose stamp was zeroed since. Never removed.
        Liveness::Dead if used_since_stamped(&seg) => Err(RegistryError::Corrupt {
            name: name.to_string(),
            what: "the init stamp is 0 in a registry that was in use (a participant entry \
                   claimed or a sequence number drawn, which only follow the stamp): the header \
                   was overwritten; left as it is"
                .to_string(),
        }
        .into()),
        Liveness::Dead => Ok(Leftover::Abandoned {
            why: "a creation abandoned by its dead creator before it was finished",
            inode,
            creator: Some(creator),
        }),
        Liveness::Alive => Ok(Leftover::UnderWay(format!(
            "a creation under way: not stamped yet, by {creator}, which runs"
        ))),
        _ => Err(RegistryError::CreatorUnknown {
            name: name.to_string(),
            creator: creator.to_string(),
        }
        .into()),
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
            kind: crate::shm::file_kind(ft),
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
