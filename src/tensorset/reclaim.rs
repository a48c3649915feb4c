//! Removal of what dead writers and abandoned creations of tensor sets left, for `gc`
//! ([`crate::cleanup`]): each part of a set (the manifest `cuda-ipc.ts.NAME`, the generation
//! channel `cuda-ipc.tg.NAME`, the host data segment `cuda-ipc.td.NAME`, the holders segment
//! `cuda-ipc.th.NAME`) is judged by the process its own header records, by the rule a new writer
//! replaces it by (this user's only; a dead writer, or a creation abandoned half-way; an empty or
//! sparse part of any kind by its age alone, a creation under way while younger than 2 s), and
//! judged again right before it is unlinked, only while its name still stands for the file
//! judged; each part on its own (one that cannot be judged keeps no other). No part of a set goes
//! while a live process other than its writer serves it from a slot of the holders segment its
//! manifest names (a holder, a serving reader, [`is_held`]): the set stays attachable and its
//! device memory pinned until the last of them lets go or dies; the slots of its dead servers are
//! freed ([`release_dead_holders`]). Dead readers' slots and holds in a live writer's generation
//! channel are freed as the writer's watchdog frees them. Readers that still map a removed set
//! keep their mappings (VMM memory stays valid for them). Never calls CUDA.

use super::error::TensorSetError;
use super::holders::{HolderSnapshot, HoldersSegment};
use super::segment::{
    self, DATA_PREFIX, DataHeader, GENERATION_PREFIX, HEADER_PAGE, HOLDERS_PREFIX, HoldersHeader,
    MANIFEST_PREFIX, ManifestHeader,
};
use crate::channel::reclaim::{
    abandoned_in, release_dead_consumers_in, remove_abandoned_in, remove_stale_control_in,
};
use crate::error::{Error, Result};
use crate::identity::{Liveness, ProcessIdentity};
use crate::shm::versioned::{self, Blocker};
use crate::shm::{Segment, ShmError};
use std::time::Duration;

/// A part of a tensor set.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Part {
    /// The manifest segment `cuda-ipc.ts.NAME`.
    Manifest,
    /// The generation channel `cuda-ipc.tg.NAME`.
    Generation,
    /// The host data segment `cuda-ipc.td.NAME`.
    Data,
    /// The holders segment `cuda-ipc.th.NAME` (VMM sets).
    Holders,
}

impl Part {
    /// Every part, in the order they are removed (the manifest first: no new reader opens the
    /// set once it is gone; the holders segment last: it says whether the set is held).
    pub const ALL: [Part; 4] = [Part::Manifest, Part::Generation, Part::Data, Part::Holders];

    /// The segment name of this part of set `name`.
    pub fn segment_name(self, name: &str) -> String {
        let prefix = match self {
            Part::Manifest => MANIFEST_PREFIX,
            Part::Generation => GENERATION_PREFIX,
            Part::Data => DATA_PREFIX,
            Part::Holders => HOLDERS_PREFIX,
        };
        format!("{prefix}{name}")
    }

    /// In words: `manifest`, `generation channel`, `host data`, `holders`.
    pub fn word(self) -> &'static str {
        match self {
            Part::Manifest => "manifest",
            Part::Generation => "generation channel",
            Part::Data => "host data",
            Part::Holders => "holders",
        }
    }
}

/// A part of a set that may go.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct StalePart {
    /// Which part.
    pub part: Part,
    /// Its segment name.
    pub segment: String,
    /// Its size in bytes.
    pub bytes: u64,
    /// The dead writer it records (`None` for a creation abandoned before it recorded one).
    pub writer: Option<ProcessIdentity>,
    /// Why it may go.
    pub why: &'static str,
}

/// Why `part` of set `name` may go and the inode judged; `Ok(None)` when it is absent or not
/// stale (a live writer's, a creation in progress, a writer whose liveness cannot be told).
/// Every kind of part is judged first by the same rule ([`versioned::stat_blocker`]: this
/// user's, a regular file, no mode bit of `0o007`; empty or sparse, by its age alone), then by
/// its own layout.
fn judge(name: &str, part: Part) -> Result<Option<(StalePart, u64)>> {
    if is_held(name) {
        return Ok(None);
    }
    let seg_name = part.segment_name(name);
    let info = match Segment::stat(&seg_name) {
        Ok(i) => i,
        Err(Error::Shm(ShmError::NotFound { .. })) => return Ok(None),
        Err(e) => return Err(e),
    };
    // One rule for every part before its own layout reads it: this user's, a regular file, no
    // mode bit of 0o007 (else the typed error: kept, reported); empty or sparse, judged by its
    // age alone (a creation under way while young or while its creator holds the sizing lock,
    // else abandoned); shorter than its header with its pages there, `TooSmall`.
    let header_len = match part {
        Part::Generation => crate::channel::layout::HEADER_SIZE,
        Part::Manifest | Part::Data | Part::Holders => HEADER_PAGE,
    };
    match versioned::stat_blocker(&seg_name, header_len) {
        Ok(Blocker::Abandoned) => {
            return Ok(Some((
                StalePart {
                    part,
                    segment: seg_name,
                    bytes: info.len,
                    writer: None,
                    why: versioned::ABANDONED_UNSIZED,
                },
                info.inode,
            )));
        }
        Ok(Blocker::Young) => return Ok(None),
        Ok(Blocker::Sized(_)) => {}
        Err(e) if super::is_not_found(&e) => return Ok(None),
        Err(e) => return Err(e),
    }
    let writer_of = |header_writer: (ProcessIdentity, u32)| {
        let (id, _) = header_writer;
        (id.pid != 0).then_some(id)
    };
    let (why, writer) = match part {
        Part::Generation => {
            match abandoned_in(GENERATION_PREFIX, name).map_err(|e| in_set_words(name, e))? {
                Some((why, _)) => (why, None),
                None => match crate::channel::inspect::inspect_in(GENERATION_PREFIX, name) {
                    Ok(snap) if snap.producer_liveness == Liveness::Dead => {
                        ("its writer is dead", Some(snap.producer))
                    }
                    Ok(_) => return Ok(None),
                    Err(e) if super::is_not_found(&e) => return Ok(None),
                    Err(e) => return Err(e),
                },
            }
        }
        Part::Manifest | Part::Data | Part::Holders => {
            let r = match part {
                Part::Manifest => segment::replaceable::<{ segment::MANIFEST_MAGIC }>(
                    name,
                    &seg_name,
                    segment::shows_no_use,
                ),
                Part::Data => segment::replaceable::<{ segment::DATA_MAGIC }>(
                    name,
                    &seg_name,
                    segment::shows_no_use,
                ),
                _ => segment::replaceable::<{ segment::HOLDERS_MAGIC }>(
                    name,
                    &seg_name,
                    super::holders::used_since_stamped,
                ),
            };
            let why = match r {
                Ok(why) => why,
                Err(e) if super::is_not_found(&e) => return Ok(None),
                Err(Error::TensorSet(
                    TensorSetError::AlreadyExists { .. } | TensorSetError::CreationInProgress(_),
                )) => return Ok(None),
                Err(e) => return Err(e),
            };
            // The recorded writer, where the header has one (never read from a sparse file).
            let writer = if info.sparse || info.len < HEADER_PAGE as u64 {
                None
            } else {
                let seg = match Segment::open_with_min_len(&seg_name, HEADER_PAGE) {
                    Ok(seg) => seg,
                    // Gone since it was judged.
                    Err(e) if super::is_not_found(&e) => return Ok(None),
                    Err(e) => return Err(e),
                };
                match part {
                    Part::Manifest => writer_of(versioned::header::<ManifestHeader>(&seg).writer()),
                    Part::Data => writer_of(versioned::header::<DataHeader>(&seg).writer()),
                    _ => writer_of(versioned::header::<HoldersHeader>(&seg).writer()),
                }
            };
            (why, writer)
        }
    };
    Ok(Some((
        StalePart {
            part,
            segment: seg_name,
            bytes: info.len,
            writer,
            why,
        },
        info.inode,
    )))
}

/// Whether a live process other than the set's writer serves set `name` from its holders segment.
///
/// Only the holders segment the set's manifest names serves the set: one beside a manifest that
/// names none (a host, pool or legacy set) or another creation's is not this set's, whoever
/// serves it. Where the manifest cannot be read (gone, being made, damaged), a live server counts
/// unless a host data segment of this user's stands under the name (a host set, which has no
/// holders). An unreadable holders segment, and one without its stamp (no holder claims a slot
/// there), count as not held: the other parts are judged as before. Looks once: nothing is
/// waited for.
pub fn is_held(name: &str) -> bool {
    let Ok(h) = HoldersSegment::open_waiting(name, None, Duration::ZERO) else {
        return false;
    };
    if !h.held_by_live() {
        return false;
    }
    match segment::open_manifest_head(name, Duration::ZERO) {
        Ok(head) => {
            let named = head.opened.manifest.holders_generation;
            named != 0 && named == h.generation()
        }
        Err(_) => !Segment::stat(&Part::Data.segment_name(name))
            .is_ok_and(|i| i.uid == rustix::process::geteuid().as_raw()),
    }
}

/// The parts of set `name` that a dead writer or an abandoned creation left (changes nothing).
///
/// # Errors
/// The first of the typed errors naming what else is under a part's name (another user's file, a
/// FIFO, a foreign segment); [`judged_parts`] gives the stale parts beside those errors.
pub fn stale_parts(name: &str) -> Result<Vec<StalePart>> {
    let mut judged = judged_parts(name)?;
    if judged.unjudged.is_empty() {
        Ok(judged.stale)
    } else {
        Err(judged.unjudged.swap_remove(0).1)
    }
}

/// What `gc` makes of a part of a set ([`PartWithoutManifest`]).
#[derive(Debug)]
#[non_exhaustive]
pub enum Judgement {
    /// A dead writer's or an abandoned creation's: `gc` removes it.
    Stale(StalePart),
    /// Kept, for now or for good, with why: a creation that may be under way (younger than 2 s:
    /// judged again once older), a live writer's or holder's (a set being made or closed), or one
    /// whose writer's liveness cannot be told.
    Kept(&'static str),
    /// It could not be judged (another user's file, a FIFO, a foreign segment): kept, and `gc`
    /// reports it.
    Unjudged(Error),
}

/// A part of a set standing without its manifest: what a writer killed half-way, or a set being
/// made or closed right now, leaves ([`parts_without_manifest`]).
#[derive(Debug)]
#[non_exhaustive]
pub struct PartWithoutManifest {
    /// Which part (never [`Part::Manifest`]).
    pub part: Part,
    /// Its segment name.
    pub segment: String,
    /// Its size in bytes.
    pub bytes: u64,
    /// Seconds since it was made (`st_ctime`).
    pub age_secs: u64,
    /// Whether it is younger than 2 s: then a part that is not stale is kept as a creation that
    /// may be under way, and judged again once older (with no live creator, removed then): the
    /// judgement depends on its age.
    pub young: bool,
    /// What `gc` makes of it, by the rule of [`judged_parts`].
    pub judgement: Judgement,
}

/// Why a part that is not stale is kept: young (`young`), or a live process's.
const KEPT_YOUNG: &str = "younger than 2 s: a creation may be under way; judged again once 2 s \
                          old (removed then unless a live writer is recorded)";
const KEPT_LIVE: &str = "its writer runs (a set being made or closed), or whether it runs \
                         cannot be told";
const KEPT_HELD: &str = "a live holder serves the set";

/// The parts of set `name` that stand while its manifest does not (its generation channel, host
/// data, holders segment), each with what `gc` makes of it: for `cuda-ipc ls`, which shows such
/// parts as leftovers of a set without a manifest, in the words `gc` acts by. Empty when the
/// manifest stands (the set is inspected instead) or nothing stands. Changes nothing.
///
/// # Errors
/// [`crate::Error::InvalidArgument`] or [`crate::shm::ShmError::InvalidName`] for a name no set
/// can bear.
pub fn parts_without_manifest(name: &str) -> Result<Vec<PartWithoutManifest>> {
    segment::validate_set_name(name)?;
    let mut out = Vec::new();
    match Segment::stat(&Part::Manifest.segment_name(name)) {
        Err(e) if super::is_not_found(&e) => {}
        // Something stands under the manifest's name: not a set without one.
        _ => return Ok(out),
    }
    for part in [Part::Generation, Part::Data, Part::Holders] {
        let segment = part.segment_name(name);
        let info = match Segment::stat(&segment) {
            Ok(i) => i,
            Err(e) if super::is_not_found(&e) => continue,
            Err(e) => {
                out.push(PartWithoutManifest {
                    part,
                    segment,
                    bytes: 0,
                    age_secs: 0,
                    young: false,
                    judgement: Judgement::Unjudged(e),
                });
                continue;
            }
        };
        let young = Duration::from_secs(info.age_secs) < crate::shm::versioned::ABANDONED_AFTER;
        let judgement = match judge(name, part) {
            Ok(Some((p, _))) => Judgement::Stale(p),
            // Gone since the stat.
            Ok(None) if matches!(Segment::stat(&segment), Err(ref e) if super::is_not_found(e)) => {
                continue;
            }
            Ok(None) if is_held(name) => Judgement::Kept(KEPT_HELD),
            Ok(None) if young => Judgement::Kept(KEPT_YOUNG),
            Ok(None) => Judgement::Kept(KEPT_LIVE),
            Err(e) if super::is_not_found(&e) => continue,
            Err(e) => Judgement::Unjudged(e),
        };
        out.push(PartWithoutManifest {
            part,
            segment,
            bytes: info.len,
            age_secs: info.age_secs,
            young,
            judgement,
        });
    }
    Ok(out)
}

/// Every part of a set judged on its own ([`judged_parts`]).
#[derive(Debug)]
#[non_exhaustive]
pub struct JudgedParts {
    /// The parts a dead writer or an abandoned creation left.
    pub stale: Vec<StalePart>,
    /// Each part that could not be judged, with why (another user's file, a FIFO, a foreign
    /// segment under its name): kept.
    pub unjudged: Vec<(Part, Error)>,
}

/// Every part of set `name` judged on its own (changes nothing): the parts a dead writer or an
/// abandoned creation left, and each part that could not be judged with its error (that part is
/// kept). A part that cannot be judged keeps no other part: what a neighbour plants under one
/// name (anyone may make a file in `/dev/shm`) never keeps a dead writer's other parts from going.
///
/// # Errors
/// [`crate::shm::ShmError::InvalidName`] for a name that is not a set's.
pub fn judged_parts(name: &str) -> Result<JudgedParts> {
    segment::validate_set_name(name)?;
    let mut out = JudgedParts {
        stale: Vec::new(),
        unjudged: Vec::new(),
    };
    for part in Part::ALL {
        match judge(name, part) {
            Ok(Some((p, _))) => out.stale.push(p),
            Ok(None) => {}
            Err(e) => out.unjudged.push((part, e)),
        }
    }
    Ok(out)
}

/// Removes `part` of set `name` when it is still stale, judged again now, and only while its name
/// still stands for the file judged; returns why, or `Ok(None)` when nothing was touched.
///
/// # Errors
/// As [`stale_parts`]; [`Error::Os`] when the unlink fails.
pub fn remove_part(name: &str, part: Part) -> Result<Option<&'static str>> {
    segment::validate_set_name(name)?;
    let Some((p, inode)) = judge(name, part)? else {
        return Ok(None);
    };
    if part == Part::Generation {
        // The channel's own removals judge again under its rules.
        if p.writer.is_some() {
            return Ok(remove_stale_control_in(GENERATION_PREFIX, name)
                .map_err(|e| in_set_words(name, e))?
                .map(|_| p.why));
        }
        return remove_abandoned_in(GENERATION_PREFIX, name).map_err(|e| in_set_words(name, e));
    }
    Ok(Segment::unlink_if_same(&p.segment, inode)?.then_some(p.why))
}

/// Removes every stale part of set `name` ([`remove_part`] of each, every part tried whatever
/// another part's error); returns the parts removed.
///
/// # Errors
/// As [`remove_part`]: the first part's error, once every other part was tried (the stale ones
/// among them are removed all the same).
pub fn remove_stale(name: &str) -> Result<Vec<Part>> {
    segment::validate_set_name(name)?;
    let mut out = Vec::new();
    let mut first = None;
    for part in Part::ALL {
        match remove_part(name, part) {
            Ok(Some(_)) => out.push(part),
            Ok(None) => {}
            Err(e) => {
                first.get_or_insert(e);
            }
        }
    }
    match first {
        None => Ok(out),
        Some(e) => Err(e),
    }
}

/// The slots of dead servers (holders, serving and writerless readers, a writer) in set `name`'s
/// holders segment, as read now (changes nothing); none when the set has no holders segment.
///
/// # Errors
/// As the holders segment's open, less a missing one (another user's, a FIFO, a foreign or
/// damaged segment: a typed error, nothing touched).
pub fn dead_holders(name: &str) -> Result<Vec<HolderSnapshot>> {
    Ok(match open_holders(name)? {
        Some(h) => h
            .snapshot()
            .into_iter()
            .filter(|s| s.liveness == Liveness::Dead)
            .collect(),
        None => Vec::new(),
    })
}

/// Frees the slots of dead servers in set `name`'s holders segment, each only while it is still
/// the dead server's (a live server's slot, and one whose liveness cannot be told, is never
/// touched); returns those freed.
///
/// # Errors
/// As [`dead_holders`].
pub fn release_dead_holders(name: &str) -> Result<Vec<HolderSnapshot>> {
    Ok(match open_holders(name)? {
        Some(h) => h.free_dead(),
        None => Vec::new(),
    })
}

/// The holders segment of set `name` (`None`: it has none, or it is empty or sparse, a creation
/// under way or abandoned by the rule every part is judged by ([`judge`]): no slot is claimed
/// before a holders segment is sized and stamped, so it serves nobody).
fn open_holders(name: &str) -> Result<Option<HoldersSegment>> {
    segment::validate_set_name(name)?;
    match versioned::stat_blocker(&Part::Holders.segment_name(name), HEADER_PAGE) {
        Ok(Blocker::Sized(_)) => {}
        Ok(_) => return Ok(None),
        Err(Error::Shm(ShmError::NotFound { .. })) => return Ok(None),
        Err(e) => return Err(e),
    }
    match HoldersSegment::open(name, None) {
        Ok(h) => Ok(Some(h)),
        Err(Error::Shm(ShmError::NotFound { .. })) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Frees the slots and holds of dead readers of set `name` (a live writer's), as the writer's
/// watchdog does; returns the holds forced.
///
/// # Errors
/// As the generation channel's open.
pub fn release_dead_readers(name: &str) -> Result<u64> {
    segment::validate_set_name(name)?;
    release_dead_consumers_in(GENERATION_PREFIX, name).map_err(|e| in_set_words(name, e))
}

/// An error of set `name`'s generation channel in the set's words: the channel layer's "no
/// channel named" (which tells the user to start a producer) is the set's
/// [`TensorSetError::NotFound`]; other errors name the segment already.
fn in_set_words(name: &str, e: Error) -> Error {
    match e {
        Error::Channel(crate::channel::ChannelError::NotFound(_)) => {
            TensorSetError::NotFound(name.to_string()).into()
        }
        e => e,
    }
}
