//! The versioned create/open protocol of a named segment, written once for every layout built on
//! [`Segment`]: the registry, the channel's control segment and a host channel's buffer pool.
//!
//! A layout describes its header with [`VersionedHeader`] (where its magic, layout version, init
//! stamp and creation generation are, and what they must hold); the protocol is then:
//! - create: [`Segment::create`] (`O_CREAT | O_EXCL`, the exact mode, every page reserved). A
//!   creator that may replace what it finds under the name goes through [`create_replacing`]: the
//!   layout's judge says whether the segment there may go, and only the object judged is removed
//!   ([`Segment::unlink_if_same`]), at most four times before the name counts as taken;
//!   [`stat_blocker`] is the judgement's first, layout-free part (owner, empty or sparse, size);
//! - initialise: [`write_versioned`]: the creator's identity (the layout's own words), a new
//!   generation ([`new_generation`]) and the layout version, then the magic with `Release`, the
//!   layout's other fields, and the init stamp last with `Release`;
//! - open: [`open_versioned`]: [`Segment::open_with_min_len`] (never through a link, a regular
//!   file, at least the header, every page backed), the owner check, a bounded wait for the stamp,
//!   then magic and layout version; [`look`] is one such check, for an opener that waits in its own
//!   way; [`open_versioned_unless_abandoned`] waits for the stamp only while the creator the layout
//!   reads may still write it, and tells a header whose stamp was zeroed under a live creator
//!   from a creation in progress by one rule ([`StampWait`], [`STAMP_DUE`]).
//!
//! What the segment itself reports (missing, another user's, sparse, too small) is a
//! [`crate::Error`], [`ShmError`] as [`Segment`] gives it. What the header says is a
//! [`HeaderError`], which each layer turns into its own error (`RegistryError::VersionMismatch`,
//! `ChannelError::VersionMismatch`, ...): the words belong to the layout, and so do the texts.
//! What stays with each layer: how its creator's identity is stored, how a creation whose stamp
//! never came is judged (whose liveness decides, after how long), which of its words show use
//! that only follows the stamp (so that a segment in use whose header was overwritten is never
//! taken for an abandoned creation: [`Creator::judged`]), and the checks of its own header
//! fields.
//!
//! Imports only `error`, `sync` and the rest of `shm`: the creator's identity is written and read
//! by the layer's own closures, so `shm` knows nothing of processes.

use super::{Segment, SegmentInfo, SegmentOptions, ShmError};
use crate::error::{Error, Result};
use crate::sync::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How old an empty, sparse or never stamped segment must be before a creator may take it for one
/// abandoned half-way (a live creator gets past those states within milliseconds, and holds its
/// sizing lock while it is empty or sparse: [`SegmentInfo::sizing`]).
pub(crate) const ABANDONED_AFTER: Duration = Duration::from_secs(2);

/// How many times [`create_replacing`] judges and removes what it finds before it gives up.
const REPLACE_ATTEMPTS: u32 = 4;

/// A header's init stamp word and the value its creator stores there last.
#[derive(Clone, Copy, Debug)]
pub(crate) enum StampWord<'a> {
    /// A `u32` stamp (the channel's control segment, the host pool).
    U32(&'a AtomicU32, u32),
    /// A `u64` stamp (the registry).
    U64(&'a AtomicU64, u64),
}

impl StampWord<'_> {
    /// The word's value (widened) and whether it is the stamp, loaded with `ordering`.
    fn load(self, ordering: Ordering) -> (u64, bool) {
        match self {
            StampWord::U32(w, v) => {
                let x = w.load(ordering);
                (u64::from(x), x == v)
            }
            StampWord::U64(w, v) => {
                let x = w.load(ordering);
                (x, x == v)
            }
        }
    }

    fn store(self, ordering: Ordering) {
        match self {
            StampWord::U32(w, v) => w.store(v, ordering),
            StampWord::U64(w, v) => w.store(v, ordering),
        }
    }
}

/// A segment header that follows the versioned protocol: a `u64` magic, a `u32` layout version, an
/// init stamp and a `u64` creation generation, wherever the layout puts them.
///
/// # Safety
/// An implementor promises, so that [`header`] may hand out `&Self` over a mapping:
/// 1. `Self` is `#[repr(C)]` and made only of atomics of `crate::sync` (and arrays of them): every
///    bit pattern is a valid value, and a shared reference permits the concurrent writes of other
///    processes; no plain byte is ever referenced;
/// 2. `align_of::<Self>()` divides 4096 (mappings start on a page);
/// 3. `size_of::<Self>() <= Self::HEADER_LEN`.
pub(crate) unsafe trait VersionedHeader {
    /// The magic at the header's start, as a little-endian `u64`.
    const MAGIC: u64;
    /// The layout version this build writes and reads.
    const VERSION: u32;
    /// Bytes an opener needs before it reads the header (at least the header's size).
    const HEADER_LEN: usize;
    /// Whether a magic that is neither 0 nor [`Self::MAGIC`] is refused while the stamp is still
    /// awaited (`true`), or only once the stamp is there (`false`: the host pool's opener).
    const FOREIGN_BEFORE_STAMP: bool = true;
    /// Whether a stamp word that is neither 0 nor the stamp is refused at once
    /// ([`HeaderError::BadStamp`]: the registry), or awaited like 0 (`false`).
    const STRICT_STAMP: bool = false;

    /// The magic word.
    fn magic(&self) -> &AtomicU64;
    /// The layout version word.
    fn version(&self) -> &AtomicU32;
    /// The init stamp word and the stamp.
    fn stamp(&self) -> StampWord<'_>;
    /// The creation generation word.
    fn generation(&self) -> &AtomicU64;
}

/// What a header says that makes an opener refuse it. The layer that owns the layout names it in
/// its own error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub(crate) enum HeaderError {
    /// Another magic: a file of another program, or of another layout of this crate.
    Foreign {
        /// The magic found.
        magic: u64,
    },
    /// This layout's magic, another layout version (`VERSION` of the layout is the supported one).
    OtherVersion {
        /// The version found.
        found: u32,
    },
    /// A stamp word that is neither 0 nor the stamp (only with
    /// [`VersionedHeader::STRICT_STAMP`]).
    BadStamp {
        /// The word found, widened to `u64`.
        found: u64,
    },
    /// No init stamp after the wait.
    Unstamped {
        /// The wait the opener was given.
        waited: Duration,
    },
    /// No init stamp, and none will come: its creator is dead, or none is recorded in a segment
    /// [`ABANDONED_AFTER`] old ([`open_versioned_unless_abandoned`], at once or as soon as that
    /// holds): a creation abandoned half-way.
    Abandoned,
    /// No init stamp after the wait, though the creator the header records ran, recorded, for at
    /// least [`STAMP_DUE`] of it without stamping ([`StampWait`]): not a creation in progress
    /// (one stamps within milliseconds of recording its creator) but a header overwritten since
    /// (its stamp zeroed), or a creator stopped.
    Overwritten {
        /// The wait the opener was given.
        waited: Duration,
    },
    /// No init stamp, in a segment that shows use which only follows the stamp (the layout's
    /// [`Creator::InUse`]: a consumer's slot claimed, a frame published, ...): not a creation,
    /// abandoned or in progress, but a segment in use whose header was overwritten since (its
    /// stamp zeroed, whatever creator it records). Told at once; never awaited, never removed.
    InUse,
}

/// Why [`open_versioned`] gave no segment.
#[derive(Debug)]
pub(crate) enum OpenError {
    /// The segment itself (missing, another user's, not a file, sparse, too small) or a call:
    /// the error as [`Segment`] gives it, to be passed on unchanged.
    Segment(Error),
    /// The header's words (magic, version, stamp): the layer names it in its own error.
    Header(HeaderError),
}

/// The header at the start of `seg`, as a shared reference to atomics.
///
/// # Panics
/// When `seg` is shorter than [`VersionedHeader::HEADER_LEN`] (every creator and opener here
/// checks that first).
pub(crate) fn header<H: VersionedHeader>(seg: &Segment) -> &H {
    assert!(
        seg.len() >= H::HEADER_LEN,
        "a segment shorter than its header"
    );
    // (1) The mapping holds at least HEADER_LEN >= size_of::<H>() bytes (asserted above, and the
    // trait's contract 3) and lives as long as `seg`, which the returned reference borrows; (2) it
    // starts on a page, so H's alignment holds (contract 2); (3) H consists only of atomics, so a
    // shared reference permits the concurrent writes of other processes (contract 1).
    // SAFETY: (1)-(3) above; (4) every bit pattern is a valid atomic integer (contract 1).
    unsafe { &*seg.as_ptr().cast::<H>() }
}

/// Writes a new segment's header in the protocol's order and returns the generation written:
/// `owner(h)` (the creator's identity, `Relaxed` stores), a new generation and the layout version
/// (`Relaxed`), the magic (`Release`), `fields(h)` (everything else of the layout, `Relaxed` or
/// plain), and the init stamp last (`Release`).
///
/// # Panics
/// As [`header`].
pub(crate) fn write_versioned<H: VersionedHeader>(
    seg: &Segment,
    owner: impl FnOnce(&H),
    fields: impl FnOnce(&H),
) -> u64 {
    let h = header::<H>(seg);
    let generation = new_generation();
    // Relaxed stores: all published by the Release stores of the magic and of the stamp below.
    owner(h);
    h.generation().store(generation, Ordering::Relaxed);
    h.version().store(H::VERSION, Ordering::Relaxed);
    // SYNC POINT creator: Release, pairs with the Acquire load of the magic by a judge of a
    // segment that was never stamped (the registry's `remove_if_stale`): whoever sees the magic
    // sees the creator's identity and the version.
    h.magic().store(H::MAGIC, Ordering::Release);
    fields(h);
    // SYNC POINT stamp: Release, pairs with the Acquire load of the stamp in `look`; everything
    // above is visible to an opener that sees the stamp.
    h.stamp().store(Ordering::Release);
    generation
}

/// What one look at a header found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Look {
    /// Stamped, this layout's magic and version: every field the creator wrote is visible.
    Ready,
    /// No stamp yet, and nothing that refuses it: a creator may still be writing.
    Unstamped,
    /// Refused for what it says.
    Refused(HeaderError),
}

/// Looks once at `h`: the stamp (`Acquire`), then the magic and the version.
///
/// A creator's segment reads zero until it stores the magic, so a magic of 0 is awaited like a
/// missing stamp; any other magic is refused without waiting (unless
/// [`VersionedHeader::FOREIGN_BEFORE_STAMP`] is `false`).
pub(crate) fn look<H: VersionedHeader>(h: &H) -> Look {
    // SYNC POINT stamp: Acquire, pairs with the Release store of the stamp in `write_versioned`;
    // when it is set, the fields read below are the creator's.
    let (found, set) = h.stamp().load(Ordering::Acquire);
    if !set && !H::FOREIGN_BEFORE_STAMP {
        return Look::Unstamped;
    }
    // Relaxed: ordered by the Acquire above when the stamp is set; otherwise only a diagnosis.
    let magic = h.magic().load(Ordering::Relaxed);
    // Awaited: no stamp yet (with STRICT_STAMP: a stamp word still zero).
    let blank = if H::STRICT_STAMP { found == 0 } else { !set };
    if magic != H::MAGIC && !(magic == 0 && blank) {
        return Look::Refused(HeaderError::Foreign { magic });
    }
    if !set {
        return if blank {
            Look::Unstamped
        } else {
            Look::Refused(HeaderError::BadStamp { found })
        };
    }
    // Relaxed: ordered by the Acquire load of the stamp.
    let version = h.version().load(Ordering::Relaxed);
    if version != H::VERSION {
        return Look::Refused(HeaderError::OtherVersion { found: version });
    }
    Look::Ready
}

/// How long an opener looks again at a young segment that is still empty, short or sparse without
/// its sizing lock held ([`SIZING_LOCK_OFFSET`](super::SIZING_LOCK_OFFSET): the instant between a
/// creator's `shm_open` and its lock, or a creator that takes no such lock), from when it first
/// saw that file. One whose lock is held by a creator it trusts is waited for as long as the
/// opener's own wait.
pub(crate) const SIZING_WAIT: Duration = Duration::from_millis(50);

/// Opens the segment `name` of layout `H`: [`Segment::open_with_min_len`] with
/// [`VersionedHeader::HEADER_LEN`] (a segment that is empty, short or sparse, as a creator sizing
/// it leaves it for a while, looked at again every millisecond: within `wait` while its creator
/// holds the sizing lock, for up to [`SIZING_WAIT`] from the first look while it is young without
/// it; never one the access check below would refuse, which is refused at once), then [`Segment::check_access`] with `allow_group` (or
/// [`Segment::check_owner`] without it), then [`look`] every millisecond until the stamp is there,
/// at most `wait`.
///
/// # Errors
/// [`OpenError::Segment`] with the errors of [`Segment::open_with_min_len`],
/// [`Segment::check_access`] and [`Segment::check_owner`]; [`OpenError::Header`] with what
/// [`look`] refused, or [`HeaderError::Unstamped`] after `wait`.
pub(crate) fn open_versioned<H: VersionedHeader>(
    name: &str,
    allow_group: bool,
    wait: Duration,
) -> std::result::Result<Segment, OpenError> {
    open_versioned_judging::<H>(name, allow_group, wait, None)
}

/// How often [`open_versioned_unless_abandoned`] judges again, while it waits for a stamp,
/// whether the creator may still write it (the creator's liveness, the segment's age).
const JUDGE_EVERY: Duration = Duration::from_millis(20);

/// [`open_versioned`], with `creator` (given the mapped segment) asked at the first look that
/// finds no stamp and every [`JUDGE_EVERY`] after, while it waits: [`Creator::InUse`],
/// [`HeaderError::InUse`] at once; once [`may_still_stamp`] says the stamp never comes,
/// [`HeaderError::Abandoned`], at once; at the end of the wait,
/// [`HeaderError::Overwritten`] where [`StampWait`] says so, else [`HeaderError::Unstamped`].
fn open_versioned_judging<H: VersionedHeader>(
    name: &str,
    allow_group: bool,
    wait: Duration,
    creator: Option<&dyn Fn(&Segment) -> Creator>,
) -> std::result::Result<Segment, OpenError> {
    let start = Instant::now();
    // The inode last looked at and when it was first seen: `SIZING_WAIT` counts from then.
    let mut seen: Option<(u64, Instant)> = None;
    // Whether a segment removed under the open was looked at again past `wait` (once).
    let mut relooked = false;
    let seg = loop {
        match Segment::open_with_min_len(name, H::HEADER_LEN) {
            Ok(seg) => break seg,
            // A creator between `shm_open` and the end of `fallocate`: the file is empty, short
            // or sparse for a while (a large `fallocate` takes seconds). Looked at again every
            // 1 ms within `wait` while one of these holds; otherwise the error, at once (an old
            // unlocked one is a creation abandoned half-way: never mapped).
            Err(e @ Error::Shm(ShmError::Sparse { .. } | ShmError::TooSmall { .. })) => {
                let info = Segment::stat(name);
                // Removed since the open looked (a creator that gave up its half-made file, or a
                // cleaner): looked at again as a first open, which says what stands under the
                // name now (`NotFound`, or the next creation, judged afresh).
                if matches!(info, Err(Error::Shm(ShmError::NotFound { .. })))
                    && (start.elapsed() < wait || !std::mem::replace(&mut relooked, true))
                {
                    continue;
                }
                // One this opener may not open (another user's; with `allow_group` also one not
                // shared with a group of ours, or open to others) is refused by whose it is, at
                // once: only a creation it could open is waited for.
                if let Ok(i) = &info
                    && let Err(denied) = i.may_open(name, allow_group)
                {
                    return Err(OpenError::Segment(denied));
                }
                let again = start.elapsed() < wait
                    && info.is_ok_and(|i| {
                        let first = match seen {
                            Some((inode, at)) if inode == i.inode => at,
                            _ => seen.insert((i.inode, Instant::now())).1,
                        };
                        let unbacked = i.len == 0 || i.sparse;
                        // Sized since the open looked (its `fallocate` ended in between).
                        (!unbacked && i.len >= H::HEADER_LEN as u64)
                            // Its creator holds the sizing lock.
                            || (unbacked && i.sizing)
                            // Young without the lock (the instant before a creator takes it).
                            || (unbacked
                                && first.elapsed() < SIZING_WAIT
                                && i.age_secs < ABANDONED_AFTER.as_secs())
                    });
                if !again {
                    return Err(OpenError::Segment(e));
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => return Err(OpenError::Segment(e)),
        }
    };
    if allow_group {
        seg.check_access(true)
    } else {
        seg.check_owner()
    }
    .map_err(OpenError::Segment)?;
    let h = header::<H>(&seg);
    let mut stamp_wait = StampWait::new();
    loop {
        match look(h) {
            Look::Ready => break,
            Look::Refused(e) => return Err(OpenError::Header(e)),
            Look::Unstamped => {
                let over = start.elapsed() > wait;
                if let Some(creator) = creator
                    && (over || stamp_wait.due())
                {
                    let c = creator(&seg);
                    if c == Creator::InUse {
                        return Err(OpenError::Header(HeaderError::InUse));
                    }
                    if !may_still_stamp(name, c) {
                        return Err(OpenError::Header(HeaderError::Abandoned));
                    }
                    stamp_wait.judged(c);
                }
                if over {
                    return Err(OpenError::Header(stamp_wait.verdict(wait)));
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
    Ok(seg)
}

/// How long the creator a header records may have run, recorded, without storing the stamp
/// before an opener that waited for it takes the header for overwritten
/// ([`HeaderError::Overwritten`]) rather than a creation in progress.
///
/// Safe because of what a creator does between recording itself and stamping
/// ([`write_versioned`]): its identity is its first store, after the segment was made, sized and
/// its pages reserved (`fallocate`, the one step that may take seconds, comes before, under the
/// sizing lock) and after the generation was drawn; then come a handful of stores of header words
/// and the layout's `fields`, which only copy what was computed before the segment was made (the
/// channel's tokens of buffers already allocated, a tensor set's encoded manifest body, a few
/// counts) into pages already reserved; then the stamp. No allocation, no GPU call, no system call
/// that waits: microseconds, milliseconds for the largest manifest. 500 ms is a hundred times
/// that and more, and it counts only from the first look that found the creator recorded and
/// running (a creator still sizing, or one not recorded yet, never starts it), so only a
/// creator stopped or starved of a CPU for half a second is taken for an overwritten header: its
/// opener is told that the header was overwritten "or its creator is stopped".
pub(crate) const STAMP_DUE: Duration = Duration::from_millis(500);

/// The one rule by which an opener that waited in vain for a stamp tells a header overwritten
/// since its creation (its stamp zeroed) from a creation in progress: [`HeaderError::Overwritten`]
/// when the creator the header records was judged [`Creator::Running`] at every judgement from
/// one at least [`STAMP_DUE`] before the end of the wait to the last one, made at its end; else
/// [`HeaderError::Unstamped`]. Used by [`open_versioned_unless_abandoned`] and by the openers that
/// wait in their own way (the registry's).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct StampWait {
    /// When the creator was last judged.
    judged: Option<Instant>,
    /// Since when every judgement found the creator recorded and running.
    running_since: Option<Instant>,
    /// Whether the last judgement found it so.
    running: bool,
}

impl StampWait {
    /// A wait with no judgement made yet.
    pub(crate) fn new() -> StampWait {
        StampWait::default()
    }

    /// Whether the creator is to be judged again: at the first look without a stamp, then every
    /// [`JUDGE_EVERY`].
    pub(crate) fn due(&self) -> bool {
        self.judged.is_none_or(|t| t.elapsed() >= JUDGE_EVERY)
    }

    /// Records a judgement of the creator, made now.
    pub(crate) fn judged(&mut self, creator: Creator) {
        let now = Instant::now();
        self.judged = Some(now);
        self.running = creator == Creator::Running;
        if !self.running {
            self.running_since = None;
        } else if self.running_since.is_none() {
            self.running_since = Some(now);
        }
    }

    /// What a wait of `waited` without a stamp ends in, the creator judged at its end: see the
    /// type.
    pub(crate) fn verdict(&self, waited: Duration) -> HeaderError {
        match self.running_since {
            Some(t) if self.running && t.elapsed() >= STAMP_DUE => {
                HeaderError::Overwritten { waited }
            }
            _ => HeaderError::Unstamped { waited },
        }
    }
}

/// The creator a segment found without its stamp records, as its layout reads it (for
/// [`open_versioned_unless_abandoned`]), or that the segment is no creation at all
/// ([`Creator::InUse`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Creator {
    /// None recorded yet (a creator writes its identity first, right after sizing the file).
    Unrecorded,
    /// Recorded, and it runs (or whether it runs cannot be told): it may still stamp.
    Running,
    /// Recorded, and it is dead: the stamp never comes.
    Dead,
    /// The segment shows use that only follows its stamp (words a creator leaves zero and only
    /// processes that opened the stamped segment write: a consumer's or holder's slot claimed, a
    /// sequence number past its first value), whatever creator it records: a segment in use
    /// whose header was overwritten (its stamp zeroed, its creator words replaced, by a peer
    /// that maps it writable), never a creation abandoned or in progress. Openers refuse it at
    /// once ([`HeaderError::InUse`]); judges never remove it.
    InUse,
}

impl Creator {
    /// The one judgement of a segment without its stamp, given by each layout: [`Creator::InUse`]
    /// when `used` (the layout's sign of use that only follows the stamp, asked first) says so;
    /// else the creator the layout records (`recorded`: its identity is there), dead as `dead`
    /// says (asked of a recorded one only).
    pub(crate) fn judged(
        recorded: bool,
        dead: impl FnOnce() -> bool,
        used: impl FnOnce() -> bool,
    ) -> Creator {
        if used() {
            Creator::InUse
        } else if !recorded {
            Creator::Unrecorded
        } else if dead() {
            Creator::Dead
        } else {
            Creator::Running
        }
    }
}

/// Whether the segment `name`, found without its stamp and recording `creator`, may still get
/// its stamp: its creator runs (or whether it runs cannot be told), or none is recorded yet in a
/// segment whose last status change (`st_ctime`, whole seconds) is younger than
/// [`ABANDONED_AFTER`] (a segment that cannot be looked at counts as young): the age by which
/// [`stat_blocker`] takes an empty or sparse one for abandoned. Otherwise it is a creation
/// abandoned half-way. The one rule of [`open_versioned_unless_abandoned`] and of the layouts'
/// judges that do not wait ([`Creation`]). A segment [`Creator::InUse`] never gets its stamp
/// back either (`false`), but is no abandoned creation: every caller tells it apart first.
pub(crate) fn may_still_stamp(name: &str, creator: Creator) -> bool {
    match creator {
        Creator::Running => true,
        Creator::Unrecorded => Segment::stat(name)
            .map(|i| i.age_secs < ABANDONED_AFTER.as_secs())
            .unwrap_or(true),
        Creator::Dead | Creator::InUse => false,
    }
}

/// A layout's judgement, without waiting, of a segment of its name that an opener could not use,
/// by the rule its creators replace one by: for `gc`'s scan, which removes what was abandoned,
/// keeps (with why) what may still be finished, and reports the rest as the opener did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Creation {
    /// This user's creation abandoned half-way: why, in words.
    Abandoned(&'static str),
    /// A creation that may still be finished: empty or sparse while young or being sized
    /// ([`UNDER_WAY_UNSIZED`]), or without its stamp while [`may_still_stamp`] says so. Why, in
    /// words, starting with "a creation under way" (or "a creation not stamped yet" when whether
    /// its creator runs cannot be told).
    UnderWay(String),
    /// No creation under way or abandoned: stamped (finished since the opener looked, or refused
    /// for what its header holds); what an opener says of it stands.
    Finished,
}

/// The judgement of [`Blocker::Young`] in words, for a tool's line on what it keeps.
pub(crate) const UNDER_WAY_UNSIZED: &str =
    "a creation under way: empty or sparse, younger than 2 s or being sized by its creator";

/// A creation without its stamp and no creator recorded, younger than [`ABANDONED_AFTER`], in
/// words.
pub(crate) const UNDER_WAY_UNSTAMPED: &str =
    "a creation under way: not stamped yet, younger than 2 s";

/// [`open_versioned`] for an opener that must not wait for a stamp nobody will write: a
/// segment without its stamp is awaited (up to `wait`, as [`open_versioned`] does, an empty,
/// short or sparse one included while its creator may be sizing it) only while a creator may
/// still write it: `creator` (given the mapped segment) says [`Creator::Running`], or
/// [`Creator::Unrecorded`] in a segment whose last status change (`st_ctime`, whole seconds) is
/// younger than [`ABANDONED_AFTER`] ([`may_still_stamp`]), judged at the first look and again
/// every [`JUDGE_EVERY`] while it waits. Any other unstamped segment (its creator dead, or none
/// recorded in an older one: a creation abandoned half-way) is [`HeaderError::Abandoned`], at
/// once, or as soon as it comes of age or its creator dies: a directory of such leftovers costs a
/// tool no wait for each, and an attach to one no 2 s wait. A wait that ends without the stamp
/// is judged by [`StampWait`]'s rule: a creator that ran, recorded, for [`STAMP_DUE`] or more of
/// it without stamping leaves no creation in progress but a header overwritten since. A segment
/// that shows use which only follows the stamp ([`Creator::InUse`]) is
/// [`HeaderError::InUse`], at once.
///
/// # Errors
/// As [`open_versioned`]; [`HeaderError::InUse`] for a segment in use whose header was
/// overwritten; [`HeaderError::Abandoned`] for a creation abandoned half-way;
/// [`HeaderError::Overwritten`] instead of [`HeaderError::Unstamped`] after a wait in which the
/// recorded creator ran, recorded and unstamped, for at least [`STAMP_DUE`].
pub(crate) fn open_versioned_unless_abandoned<H: VersionedHeader>(
    name: &str,
    allow_group: bool,
    wait: Duration,
    creator: impl Fn(&Segment) -> Creator,
) -> std::result::Result<Segment, OpenError> {
    open_versioned_judging::<H>(name, allow_group, wait, Some(&creator))
}

/// What stands under a name that a creation found taken, judged from `fstat` alone (nothing
/// mapped, nothing read).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Blocker {
    /// Empty (a creator killed before `ftruncate`) or sparse (before `fallocate`), at least
    /// [`ABANDONED_AFTER`] old and its sizing lock free: a creation abandoned before its pages
    /// were reserved. Never read:
    /// touching a hole may raise `SIGBUS`.
    Abandoned,
    /// Empty or sparse, younger than [`ABANDONED_AFTER`] or with its creator's sizing lock held
    /// ([`SegmentInfo::sizing`]): a creator may be sizing it now.
    Young,
    /// Pages reserved, at least the header long: the layout judges it by its header.
    Sized(SegmentInfo),
}

/// The judgement of [`Blocker::Abandoned`] in words, for a creator's log.
pub(crate) const ABANDONED_UNSIZED: &str = "a creation abandoned before its pages were reserved";

/// Whether `info` is a creation abandoned before its pages were reserved: empty or sparse, at
/// least [`ABANDONED_AFTER`] old, and its sizing lock free (a creator holding it is at work,
/// however old the file).
pub(crate) fn abandoned_creation(info: &SegmentInfo) -> bool {
    (info.len == 0 || info.sparse) && !info.sizing && info.age_secs >= ABANDONED_AFTER.as_secs()
}

/// The first part of judging a segment that blocks a creation: [`Segment::stat`], the owner and
/// the mode (only this user's segments that give other users no access, as the library makes
/// them, are ever replaced or removed), then empty or sparse (by age), then the size.
///
/// # Errors
/// As [`Segment::stat`]; [`ShmError::WrongOwner`] for another user's segment;
/// [`ShmError::InsecureMode`] for one with any of the mode bits `0o007` (the library never makes
/// one: it is left as it is); [`ShmError::TooSmall`] for one with its pages but shorter than
/// `header_len`.
pub(crate) fn stat_blocker(name: &str, header_len: usize) -> Result<Blocker> {
    let info = Segment::stat(name)?;
    let ours = rustix::process::geteuid().as_raw();
    if info.uid != ours {
        return Err(ShmError::WrongOwner {
            name: name.to_string(),
            owner: info.uid,
            ours,
        }
        .into());
    }
    if info.mode & 0o007 != 0 {
        return Err(ShmError::InsecureMode {
            name: name.to_string(),
            mode: info.mode,
        }
        .into());
    }
    // What a creator killed half-way leaves: an empty file (before `ftruncate`) or a sparse one
    // (before `fallocate`). Never read (a sparse file may SIGBUS); a live creator holds its sizing
    // lock until it is past both. A short file with its pages is no creation of ours: refused.
    if info.len == 0 || info.sparse {
        return Ok(if abandoned_creation(&info) {
            Blocker::Abandoned
        } else {
            Blocker::Young
        });
    }
    if info.len < header_len as u64 {
        return Err(ShmError::TooSmall {
            name: name.to_string(),
            len: info.len,
            min: header_len as u64,
        }
        .into());
    }
    Ok(Blocker::Sized(info))
}

/// Creates the segment `name` ([`Segment::create`]); when the name is taken, asks `judge` whether
/// what is there may be replaced and, when it says why (`Ok(Some(why))`), removes the object
/// judged, only while the name still stands for it ([`Segment::unlink_if_same`]), and tries again.
/// `Ok(None)` from `judge`: the name went away meanwhile, try again. `what` names the segment in
/// the warning logged on a replacement (`"channel segment"`).
///
/// Two creators replacing one stale segment at once each remove only the object they judged, so
/// the slower finds the faster one's new segment and its judge refuses it.
///
/// # Errors
/// The errors of [`Segment::create`] and [`Segment::stat`], `judge`'s errors, and
/// [`ShmError::AlreadyExists`] when the name was still taken after four replacements.
pub(crate) fn create_replacing(
    name: &str,
    len: usize,
    opts: &SegmentOptions,
    what: &str,
    mut judge: impl FnMut() -> Result<Option<&'static str>>,
) -> Result<Segment> {
    let mut attempts = 0;
    loop {
        match Segment::create(name, len, opts) {
            Ok(s) => return Ok(s),
            Err(Error::Shm(ShmError::AlreadyExists { .. })) if attempts < REPLACE_ATTEMPTS => {
                attempts += 1;
                let judged = match Segment::stat(name) {
                    Ok(i) => i.inode,
                    Err(Error::Shm(ShmError::NotFound { .. })) => continue,
                    Err(e) => return Err(e),
                };
                let Some(why) = judge()? else { continue };
                if Segment::unlink_if_same(name, judged)? {
                    tracing::warn!("replaced the {what} {name}: {why}");
                }
            }
            Err(e) => return Err(e),
        }
    }
}

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

#[cfg(all(test, not(loom)))]
mod tests {
    use super::super::SIZING_LOCK_OFFSET;
    use super::super::segment::{ofd_lock, ofd_write_locked};
    use super::*;
    use rustix::fd::OwnedFd;

    /// A header of the protocol's words only, with a `u32` stamp and the rules as parameters.
    #[repr(C)]
    struct Ruled<const FOREIGN_FIRST: bool, const STRICT: bool> {
        magic: AtomicU64,
        version: AtomicU32,
        stamp: AtomicU32,
        generation: AtomicU64,
    }

    /// The default rules (the channel's control segment).
    type Hdr = Ruled<true, false>;

    const STAMP: u32 = 0x5354_4d50;

    // SAFETY: repr(C), atomics only; 8-byte alignment; 24 bytes <= HEADER_LEN.
    unsafe impl<const F: bool, const S: bool> VersionedHeader for Ruled<F, S> {
        const MAGIC: u64 = u64::from_le_bytes(*b"TESTVERS");
        const VERSION: u32 = 7;
        const HEADER_LEN: usize = 64;
        const FOREIGN_BEFORE_STAMP: bool = F;
        const STRICT_STAMP: bool = S;
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

    fn look_at<const F: bool, const S: bool>(magic: u64, stamp: u32) -> Look {
        let h = Ruled::<F, S> {
            magic: AtomicU64::new(magic),
            version: AtomicU32::new(7),
            stamp: AtomicU32::new(stamp),
            generation: AtomicU64::new(1),
        };
        look(&h)
    }

    #[test]
    fn each_layouts_rules_give_the_answers_its_opener_always_gave() {
        use HeaderError::{BadStamp, Foreign};
        use Look::{Ready, Refused, Unstamped};
        let m = Hdr::MAGIC;
        let (x, g) = (0x1234, 0xdead);
        // (magic, stamp word) → (control segment, registry, host pool).
        let cases = [
            ((0, 0), [Unstamped, Unstamped, Unstamped]),
            ((m, 0), [Unstamped, Unstamped, Unstamped]),
            (
                (x, 0),
                [
                    Refused(Foreign { magic: x }),
                    Refused(Foreign { magic: x }),
                    Unstamped,
                ],
            ),
            ((0, STAMP), [Refused(Foreign { magic: 0 }); 3]),
            ((m, STAMP), [Ready, Ready, Ready]),
            ((x, STAMP), [Refused(Foreign { magic: x }); 3]),
            (
                (0, g),
                [Unstamped, Refused(Foreign { magic: 0 }), Unstamped],
            ),
            (
                (m, g),
                [
                    Unstamped,
                    Refused(BadStamp {
                        found: u64::from(g),
                    }),
                    Unstamped,
                ],
            ),
            (
                (x, g),
                [
                    Refused(Foreign { magic: x }),
                    Refused(Foreign { magic: x }),
                    Unstamped,
                ],
            ),
        ];
        for ((magic, stamp), want) in cases {
            let got = [
                look_at::<true, false>(magic, stamp),
                look_at::<true, true>(magic, stamp),
                look_at::<false, false>(magic, stamp),
            ];
            assert_eq!(got, want, "magic {magic:#x}, stamp {stamp:#x}");
        }
    }

    fn name(tag: &str) -> String {
        format!("cuda-ipc-versioned-{tag}-{}", std::process::id())
    }

    #[test]
    fn a_written_header_opens_and_every_refusal_names_what_it_found() {
        let n = name("open");
        let seg = Segment::create(&n, 4096, &SegmentOptions::new()).unwrap();
        let h = header::<Hdr>(&seg);
        assert_eq!(look(h), Look::Unstamped);
        let g = write_versioned::<Hdr>(&seg, |_| {}, |_| {});
        assert_ne!(g, 0);
        assert_eq!(h.generation.load(Ordering::Relaxed), g);
        assert_eq!(look(h), Look::Ready);
        assert!(open_versioned::<Hdr>(&n, false, Duration::ZERO).is_ok());
        h.version.store(8, Ordering::Relaxed);
        assert!(matches!(
            open_versioned::<Hdr>(&n, false, Duration::ZERO),
            Err(OpenError::Header(HeaderError::OtherVersion { found: 8 }))
        ));
        h.stamp.store(0, Ordering::Relaxed);
        h.magic.store(1, Ordering::Relaxed);
        assert_eq!(look(h), Look::Refused(HeaderError::Foreign { magic: 1 }));
        h.magic.store(Hdr::MAGIC, Ordering::Relaxed);
        assert!(matches!(
            open_versioned::<Hdr>(&n, false, Duration::from_millis(5)),
            Err(OpenError::Header(HeaderError::Unstamped { .. }))
        ));
        Segment::unlink(&n).unwrap();
        assert!(matches!(
            open_versioned::<Hdr>(&n, false, Duration::ZERO),
            Err(OpenError::Segment(Error::Shm(ShmError::NotFound { .. })))
        ));
    }

    #[test]
    fn a_creator_replaces_only_what_its_judge_lets_go() {
        let n = name("replace");
        let old = Segment::create(&n, 4096, &SegmentOptions::new()).unwrap();
        assert!(matches!(stat_blocker(&n, 64), Ok(Blocker::Sized(_))));
        assert!(matches!(
            stat_blocker(&n, 8192),
            Err(Error::Shm(ShmError::TooSmall { .. }))
        ));
        let refused = create_replacing(&n, 4096, &SegmentOptions::new(), "test segment", || {
            Err(Error::InvalidArgument("kept".into()))
        });
        assert!(matches!(refused, Err(Error::InvalidArgument(_))));
        let new = create_replacing(&n, 4096, &SegmentOptions::new(), "test segment", || {
            Ok(Some("a test"))
        })
        .unwrap();
        assert_ne!(new.inode().unwrap(), old.inode().unwrap());
        Segment::unlink(&n).unwrap();
    }

    /// A sparse segment whose creator holds the sizing lock is a creation in progress: judged
    /// young, waited for by openers for their whole wait (not `SIZING_WAIT`); once the lock is
    /// gone it is judged by its age again.
    #[test]
    fn a_sparse_segment_with_its_sizing_lock_held_is_waited_for_and_never_judged_abandoned() {
        use std::os::unix::fs::OpenOptionsExt;
        let n = name("sizing");
        let f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(format!("{}/{n}", crate::shm::SHM_DIR))
            .unwrap();
        f.set_len(16384).unwrap();
        let f = OwnedFd::from(f);
        assert!(!Segment::stat(&n).unwrap().sizing, "no lock yet");
        ofd_lock(&f, libc::F_WRLCK, SIZING_LOCK_OFFSET).unwrap();
        assert!(Segment::stat(&n).unwrap().sizing);
        assert!(matches!(stat_blocker(&n, 64), Ok(Blocker::Young)));
        let wait = Duration::from_millis(300);
        let t = Instant::now();
        let r = open_versioned::<Hdr>(&n, false, wait);
        assert!(
            matches!(
                r,
                Err(OpenError::Segment(Error::Shm(ShmError::Sparse { .. })))
            ),
            "{r:?}"
        );
        assert!(t.elapsed() >= wait, "gave up after {:?}", t.elapsed());
        drop(f); // the creator is gone: its lock with it
        assert!(!Segment::stat(&n).unwrap().sizing);
        Segment::unlink(&n).unwrap();
        // A finished creation keeps no lock (asked from another open file description).
        let seg = Segment::create(&n, 4096, &SegmentOptions::new()).unwrap();
        let other = std::fs::File::open(format!("{}/{n}", crate::shm::SHM_DIR)).unwrap();
        assert!(
            !ofd_write_locked(&OwnedFd::from(other), SIZING_LOCK_OFFSET),
            "the sizing lock is still held"
        );
        drop(seg);
        Segment::unlink(&n).unwrap();
    }

    /// A half-made file removed between the open's look and its `stat` (its creator gave it up)
    /// is looked at again, not reported as the sparse file it no longer is: the open says
    /// `NotFound` once nothing stands under the name. The removal lands at a varying point of
    /// the open's 1 ms looks, so some of the rounds fall between a look and its `stat`.
    #[test]
    fn a_half_made_file_removed_while_the_open_looks_is_not_reported_sparse() {
        use std::os::unix::fs::OpenOptionsExt;
        let n = name("removed-half-made");
        let path = format!("{}/{n}", crate::shm::SHM_DIR);
        for round in 0..400u64 {
            let f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&path)
                .unwrap();
            f.set_len(16384).unwrap();
            let f = OwnedFd::from(f);
            ofd_lock(&f, libc::F_WRLCK, SIZING_LOCK_OFFSET).unwrap();
            let remover = {
                let path = path.clone();
                std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_micros(500 + (round * 37) % 1000));
                    std::fs::remove_file(&path).unwrap();
                    drop(f);
                })
            };
            let r = open_versioned::<Hdr>(&n, false, Duration::from_secs(2));
            remover.join().unwrap();
            assert!(
                matches!(
                    r,
                    Err(OpenError::Segment(Error::Shm(ShmError::NotFound { .. })))
                ),
                "round {round}: {r:?}"
            );
        }
    }

    /// Only a write lock on the sizing byte marks a creation: a read lock, which anyone who can
    /// read the file may take, leaves an abandoned leftover abandoned. A sparse file sized while an
    /// opener waits on it is opened, past `SIZING_WAIT` (here it then waits for a stamp that never
    /// comes: `Unstamped`, not `Sparse`).
    #[test]
    fn a_read_lock_marks_no_creation_and_a_file_sized_while_waited_on_is_opened() {
        use std::os::unix::fs::OpenOptionsExt;
        let n = name("sizing-read");
        let path = format!("{}/{n}", crate::shm::SHM_DIR);
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .unwrap();
        f.set_len(1 << 20).unwrap();
        let f = OwnedFd::from(f);
        let reader = OwnedFd::from(std::fs::File::open(&path).unwrap());
        ofd_lock(&reader, libc::F_RDLCK, SIZING_LOCK_OFFSET).unwrap();
        assert!(!Segment::stat(&n).unwrap().sizing, "a read lock counted");
        drop(reader);
        ofd_lock(&f, libc::F_WRLCK, SIZING_LOCK_OFFSET).unwrap();
        assert!(Segment::stat(&n).unwrap().sizing);
        let sizer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            rustix::fs::fallocate(&f, rustix::fs::FallocateFlags::empty(), 0, 1 << 20).unwrap();
            drop(f); // the lock goes with the descriptor
        });
        let r = open_versioned::<Hdr>(&n, false, Duration::from_millis(300));
        assert!(
            matches!(r, Err(OpenError::Header(HeaderError::Unstamped { .. }))),
            "{r:?}"
        );
        sizer.join().unwrap();
        Segment::unlink(&n).unwrap();
    }
}
