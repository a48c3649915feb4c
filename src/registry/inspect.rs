//! Read-only inspection of registry segments, for tools (`cuda-ipc ls`, `watch`, `gc --dry-run`).
//!
//! Owns: finding registry segments in `/dev/shm` ([`list_registries`]) and copying out what one
//! holds without joining it ([`inspect`]): no participant entry is claimed, no lock is taken, no
//! abandoned write is repaired. Everything is read with the same atomic loads and seqlock copies a
//! participant uses, so inspecting never disturbs the protocol; freeing what dead processes left is
//! [`Registry::reclaim_dead`]'s job.

use super::Registry;
use super::layout::*;
use super::participant::{self, EntryState};
use super::records::{READ_RETRIES, decode};
use super::segment::{Leftover, Retry};
use crate::error::{Error, Result};
use crate::identity::{Liveness, ProcessIdentity};
use crate::registry::{Record, RegistryError};
use crate::shm::versioned::Creation;
use crate::sync::Ordering;
use std::io::Read;
use std::time::Duration;

/// One published record and whether its owner still runs.
///
/// With the `serde` feature it serialises as one flat object: `name`, `kind`, `seq`, `slot`,
/// `owner_pid` (the publisher's pid), `token_bytes` and `metadata_bytes` (lengths: the token and
/// metadata bytes themselves are left out), and `owner`, the owner's [`Liveness`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct RecordSnapshot {
    /// The record, as [`Registry::list`] would return it.
    #[cfg_attr(feature = "serde", serde(flatten, serialize_with = "json::record"))]
    pub record: Record,
    /// Whether the publishing process still runs ([`ProcessIdentity::liveness`]); a dead owner's
    /// record is freed by [`Registry::reclaim_dead`].
    #[cfg_attr(feature = "serde", serde(rename = "owner"))]
    pub owner_liveness: Liveness,
}

/// A slot whose writer lock is held: a write in progress, or one left by a dead writer.
///
/// With the `serde` feature it serialises with its field names (`writer` as `pid`, `start_time`
/// and `pid_ns`, or `null`), except `writer_dead`, which is written as its negation
/// `writer_alive`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct LockedSlot {
    /// The slot index.
    pub slot: u32,
    /// The pid of the lock holder (in its own pid namespace; 0 when its lock name leads to no
    /// sealed participant entry, i.e. its claim ended).
    pub writer_pid: u32,
    /// The lock holder, from its participant entry; `None` when the lock name leads to none.
    #[cfg_attr(
        feature = "serde",
        serde(serialize_with = "crate::identity::snapshot_json::optional")
    )]
    pub writer: Option<ProcessIdentity>,
    /// Whether the holder runs ([`ProcessIdentity::liveness`] of its entry's identity; a lock
    /// name whose entry was freed or claimed again is [`Liveness::Dead`]).
    pub writer_liveness: Liveness,
    /// `writer_liveness == Dead`: the next writer or [`Registry::reclaim_dead`] takes the lock
    /// over.
    #[cfg_attr(
        feature = "serde",
        serde(rename = "writer_alive", serialize_with = "json::negated")
    )]
    pub writer_dead: bool,
    /// Whether the holder opened the seqlock write (a half-written record would be dropped).
    pub writing: bool,
}

/// One participant entry: a process that has the registry open (or had, if it died).
///
/// With the `serde` feature it serialises as one flat object: `index`, the fields of its
/// [`ProcessIdentity`] but the boot id (`pid`, `start_time`, `pid_ns`), `sealed`, `liveness`, and
/// `dead` written as its negation `alive`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct ParticipantSnapshot {
    /// The entry index.
    pub index: u32,
    /// The process. For an entry whose claim was never completed (`sealed` false) only its pid
    /// and pid namespace are known; its start time reads 0.
    #[cfg_attr(
        feature = "serde",
        serde(flatten, serialize_with = "crate::identity::snapshot_json::identity")
    )]
    pub identity: ProcessIdentity,
    /// Whether the claim was completed (the full identity written).
    pub sealed: bool,
    /// Whether the process runs (the same test [`Registry::reclaim_dead`] uses).
    pub liveness: Liveness,
    /// `liveness == Dead`: [`Registry::reclaim_dead`] frees the entry.
    #[cfg_attr(
        feature = "serde",
        serde(rename = "alive", serialize_with = "json::negated")
    )]
    pub dead: bool,
}

/// What a registry segment holds, copied without joining it.
///
/// Fields are read one by one: on a busy registry they may belong to slightly different moments,
/// but each record is whole (copied under its seqlock).
///
/// With the `serde` feature it serialises with its field names (`cuda-ipc ls --json` prints this
/// form), `creator` as `pid`, `start_time` and `pid_ns` (the boot id is this boot's), each corrupt
/// slot as an object `{"slot": N, "reason": "..."}`.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct RegistrySnapshot {
    /// The segment name (without `/`); the file is `/dev/shm/NAME`.
    pub name: String,
    /// The segment's size in bytes.
    pub segment_bytes: u64,
    /// Number of slots (most records at once).
    pub capacity: u32,
    /// Number of participant entries.
    pub participant_capacity: u32,
    /// The registry-wide sequence counter: the number of the latest publish (0: none yet). The
    /// difference between two snapshots is the number of publishes in between.
    pub last_seq: u64,
    /// The pid of the process that created the segment (in its own pid namespace).
    pub creator_pid: u32,
    /// The process that created the segment.
    #[cfg_attr(
        feature = "serde",
        serde(serialize_with = "crate::identity::snapshot_json::identity")
    )]
    pub creator: ProcessIdentity,
    /// The creation generation: random, different for every creation of the name.
    pub generation: u64,
    /// Threads sleeping in [`Registry::wait_for`] now (waiters that died asleep stay counted).
    pub waiters: u32,
    /// Published records, in slot order.
    pub records: Vec<RecordSnapshot>,
    /// Slots whose writer lock is held now.
    pub locked_slots: Vec<LockedSlot>,
    /// Slots whose bytes make no sense, with the reason ([`Registry::reclaim_dead`] frees them).
    #[cfg_attr(feature = "serde", serde(serialize_with = "json::corrupt_slots"))]
    pub corrupt_slots: Vec<(u32, String)>,
    /// Participant entries in use, dead ones included.
    pub participants: Vec<ParticipantSnapshot>,
}

impl RegistrySnapshot {
    /// Whether [`Registry::reclaim_dead`] would free something now: records of dead owners, locks
    /// of dead writers, corrupt slots, or participant entries of dead processes.
    pub fn has_leftovers(&self) -> bool {
        self.records
            .iter()
            .any(|r| r.owner_liveness == Liveness::Dead)
            || self.locked_slots.iter().any(|l| l.writer_dead)
            || !self.corrupt_slots.is_empty()
            || self.participants.iter().any(|p| p.dead)
    }
}

/// Names of the registry segments in `/dev/shm` this process can read: the regular files whose
/// first eight bytes are the registry magic `CUIPCREG`, sorted, of this user or shared with one of
/// this process's groups (as [`inspect`] accepts them; root lists root's own). Other users'
/// segments, segments still being initialised (magic not written yet), and anything that is not a
/// regular file (a FIFO, a directory, a socket, a symbolic link) are left out.
///
/// Never blocks and never follows a link: each name is opened `O_RDONLY | O_NOFOLLOW |
/// O_NONBLOCK | O_CLOEXEC` and checked with `fstat` to be a regular file before a byte is read,
/// so a FIFO swapped in under a listed name (by anyone: `/dev/shm` is world-writable) is skipped,
/// not waited on. Sparse files are read like any other (`read` of a hole gives zeros, never
/// `SIGBUS`).
///
/// # Errors
/// [`Error::Os`] when `/dev/shm` cannot be listed.
///
/// # Examples
/// ```
/// use cuda_ipc::registry::{Registry, RegistryOptions, inspect};
/// let name = format!("cuda-ipc-doc-list-{}", std::process::id());
/// let reg = Registry::create(&name, &RegistryOptions::new().capacity(4))?;
/// assert!(inspect::list_registries()?.contains(&name));
/// Registry::unlink(&name)?;
/// # Ok::<(), cuda_ipc::Error>(())
/// ```
pub fn list_registries() -> Result<Vec<String>> {
    Ok(registries_where(ours_or_our_groups)?
        .into_iter()
        .map(|(name, _)| name)
        .collect())
}

/// The registry segments [`list_registries`] leaves out for whose they are: those of other users
/// not shared with a group of this process, each with its owner's uid, as far as this process can
/// read their magic (root can; another user's 0600 segment cannot be read by anyone else, and is
/// not found). Read as [`list_registries`] reads (never blocks, never follows a link); nothing
/// past the magic is read, and nothing is changed. For `cuda-ipc gc` and `ls`, which say what
/// they left to other users.
///
/// # Errors
/// [`Error::Os`] when `/dev/shm` cannot be listed.
///
/// # Examples
/// ```
/// use cuda_ipc::registry::inspect;
/// for (name, uid) in inspect::list_other_users_registries()? {
///     println!("registry {name} of uid {uid}: not inspected here");
/// }
/// # Ok::<(), cuda_ipc::Error>(())
/// ```
pub fn list_other_users_registries() -> Result<Vec<(String, u32)>> {
    registries_where(|m| !ours_or_our_groups(m))
}

/// The owner's uid of `name` in `/dev/shm` when it is a regular file that [`list_registries`]
/// leaves out for whose it is (another user's, not shared with a group of this process), by
/// [`list_other_users_registries`]' rule without its magic: the name was given as a registry's,
/// and another user's 0600 segment cannot be read by anyone else. `None` for a file this process
/// may inspect, for anything that is not a regular file, for an invalid name and when nothing
/// stands under it. From `lstat`: no link is followed, nothing is opened. For a `gc` of a NAME,
/// which passes over another user's registry as a `gc` of every registry does.
pub(crate) fn other_users_registry(name: &str) -> Option<u32> {
    use std::os::unix::fs::MetadataExt;
    crate::shm::validate_name(name).ok()?;
    let meta = std::fs::symlink_metadata(format!("{}/{name}", crate::shm::SHM_DIR)).ok()?;
    (meta.file_type().is_file() && !ours_or_our_groups(&meta)).then_some(meta.uid())
}

/// The regular files in `/dev/shm` whose metadata `keep` accepts and whose first eight bytes are
/// the registry magic, with their owners' uids.
fn registries_where(keep: impl Fn(&std::fs::Metadata) -> bool) -> Result<Vec<(String, u32)>> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let mut out = Vec::new();
    for name in crate::shm::list_segments()? {
        let path = format!("{}/{name}", crate::shm::SHM_DIR);
        let Ok(mut f) = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(&path)
        else {
            continue;
        };
        // The descriptor's own type: the name may have been swapped since it was listed.
        let Ok(meta) = f.metadata() else {
            continue;
        };
        if !meta.file_type().is_file() || !keep(&meta) {
            continue;
        }
        let mut magic = [0u8; 8];
        // A read into our own buffer: the kernel copies, so a concurrent writer is harmless.
        if f.read_exact(&mut magic).is_ok() && u64::from_le_bytes(magic) == MAGIC {
            out.push((name, meta.uid()));
        }
    }
    Ok(out)
}

/// Whether a segment is one this process may inspect: its own user's, or one shared with a group of
/// this process (group bits set). Other users' registries are not listed (as other users' channels
/// are not), root's listing included: root only ever looks at root's own.
fn ours_or_our_groups(meta: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    let euid = rustix::process::geteuid().as_raw();
    if meta.uid() == euid {
        return true;
    }
    meta.mode() & 0o060 != 0
        && (rustix::process::getegid().as_raw() == meta.gid()
            || rustix::process::getgroups()
                .is_ok_and(|gs| gs.iter().any(|g| g.as_raw() == meta.gid())))
}

/// Copies what the registry segment `name` holds, without joining it or changing a byte.
///
/// The segment is validated like [`Registry::open`] does (owner, mode, magic, version, sizes), but
/// without waiting for a creator that is still initialising. Each slot is copied under its seqlock;
/// a slot whose write stays open for the read attempts is reported in
/// [`RegistrySnapshot::locked_slots`] instead of being waited for or repaired.
///
/// # Errors
/// - [`Error::Shm`] with `NotFound`, `WrongOwner` (a segment of a user outside our groups),
///   `InsecureMode`, or `TooSmall`;
/// - [`RegistryError::ForeignSegment`], [`RegistryError::VersionMismatch`],
///   [`RegistryError::Corrupt`] for a segment that is not a registry of this layout;
/// - [`RegistryError::Uninitialised`] while its creator has not finished it;
/// - [`RegistryError::NoMagic`] for an empty, sparse or zero-header file at least 2 s old and not
///   being sized: no registry, as `gc` judges it ([`abandoned`]);
/// - [`Error::Os`] when a call fails.
///
/// # Examples
/// ```
/// use cuda_ipc::registry::{Registry, RegistryOptions, inspect};
/// let name = format!("cuda-ipc-doc-inspect-{}", std::process::id());
/// let reg = Registry::create(&name, &RegistryOptions::new().capacity(4))?;
/// reg.publish("frames", 7, b"token", b"meta")?;
/// let snap = inspect::inspect(&name)?;
/// assert_eq!(snap.records[0].record.name, "frames");
/// assert_eq!(snap.participants.len(), 1); // `reg`; inspecting did not join
/// Registry::unlink(&name)?;
/// # Ok::<(), cuda_ipc::Error>(())
/// ```
pub fn inspect(name: &str) -> Result<RegistrySnapshot> {
    let e = match Registry::try_open(name, true) {
        Ok((seg, slots, participants)) => return snapshot(name, seg, slots, participants),
        Err(Retry::Fatal(e)) => e,
        Err(Retry::NotReady(Error::Registry(RegistryError::Uninitialised { .. }))) => {
            RegistryError::Uninitialised {
                name: name.to_string(),
                waited: Duration::ZERO,
            }
            .into()
        }
        Err(Retry::NotReady(e)) => e,
    };
    // What a creator leaves before its header (empty, sparse, no magic) is said to be no registry
    // once it is old, as `gc` judges it: nothing shows that a registry creator made it.
    match &e {
        Error::Registry(RegistryError::Uninitialised { .. })
        | Error::Shm(crate::shm::ShmError::TooSmall { .. } | crate::shm::ShmError::Sparse { .. }) => {
            match super::segment::judge_leftover(name) {
                Err(no @ Error::Registry(RegistryError::NoMagic { .. })) => Err(no),
                _ => Err(e),
            }
        }
        _ => Err(e),
    }
}

/// [`inspect`] of the registry segment `seg`, opened and checked, with its counts.
fn snapshot(
    name: &str,
    seg: crate::shm::Segment,
    slots: u32,
    participants: u32,
) -> Result<RegistrySnapshot> {
    let segment_bytes = seg.len() as u64;
    let me = ProcessIdentity::current()?;
    // An observer handle: it holds no participant entry (its drop frees none) and takes no lock.
    // Only the read-only helpers below are called on it.
    let reg = Registry::observer(seg, slots, participants, me)?;
    let hdr = reg.header();
    let creator = ProcessIdentity::load_words(&hdr.creator);
    let mut snap = RegistrySnapshot {
        name: name.to_string(),
        segment_bytes,
        capacity: slots,
        participant_capacity: participants,
        // Relaxed: diagnostic values; nothing else is read through them.
        last_seq: hdr.next_seq.load(Ordering::Relaxed),
        creator_pid: creator.pid,
        creator,
        generation: reg.generation(),
        waiters: hdr.waiters.load(Ordering::Relaxed),
        records: Vec::new(),
        locked_slots: Vec::new(),
        corrupt_slots: Vec::new(),
        participants: Vec::new(),
    };
    let mut buf = [0u64; PAYLOAD_WORDS];
    for i in 0..slots {
        let v = reg.view(i);
        let holder = v.holder();
        let read = v.read(&mut buf, READ_RETRIES);
        if holder != 0 {
            let (writer_liveness, writer) = reg.holder_liveness(holder);
            snap.locked_slots.push(LockedSlot {
                slot: i,
                writer_pid: writer.map_or(0, |w| w.pid),
                writer,
                writer_liveness,
                writer_dead: writer_liveness == Liveness::Dead,
                writing: read.is_err() || v.lock.sequence() & 1 == 1,
            });
        }
        match read {
            Ok(_) => match decode(&buf, i) {
                Ok(Some(record)) => snap.records.push(RecordSnapshot {
                    owner_liveness: record.owner_liveness(),
                    record,
                }),
                Ok(None) => {}
                Err(what) => snap.corrupt_slots.push((i, what)),
            },
            // An odd sequence with no holder cannot come from a live writer.
            Err(_) if holder == 0 => snap
                .corrupt_slots
                .push((i, format!("slot {i}: write left open with no writer"))),
            Err(_) => {}
        }
    }
    for i in 0..participants {
        let state = reg.entry(i);
        let (identity, sealed) = match state {
            EntryState::Free | EntryState::Changing => continue,
            EntryState::Held { identity, .. } => (identity, true),
            EntryState::Claiming { owner } => {
                let (pid, pid_ns) = participant::claimer_of(owner);
                let identity = ProcessIdentity {
                    pid,
                    start_time: 0,
                    boot_id: me.boot_id,
                    pid_ns,
                };
                (identity, false)
            }
        };
        let liveness = reg.entry_liveness(&state);
        snap.participants.push(ParticipantSnapshot {
            index: i,
            identity,
            sealed,
            liveness,
            dead: liveness == Liveness::Dead,
        });
    }
    Ok(snap)
}

/// Whether the segment `name` is a registry creation abandoned half-way, by the rule `gc`
/// removes one by: this user's, giving other users no access, with the registry magic and this
/// layout version, never stamped, and its recorded creator dead (the creator's identity, written
/// before the magic, is the evidence that a cuda-ipc creation made it and died). Returns why, or
/// `Ok(None)`: no such segment, a finished registry (its dead processes' leftovers are
/// [`Registry::reclaim_dead`]'s), a young creation or a live creator's. Removing it is
/// [`super::remove_abandoned`]'s.
///
/// A file without the magic is never one: a registry's name is any name, and an empty, sparse or
/// zero-header file of another program (a `multiprocessing.shared_memory` segment) looks as a
/// registry creation killed before its header would. At least 2 s old and not being sized it is
/// [`RegistryError::NoMagic`]; younger, or being sized, `Ok(None)` (it may be a creation under
/// way). [`Registry::open_or_create`] never replaces such a file either.
///
/// # Errors
/// The typed errors that say what else is under the name and why it is kept
/// ([`crate::shm::ShmError::WrongOwner`] for another user's segment,
/// [`crate::shm::ShmError::NotASegment`], [`crate::shm::ShmError::TooSmall`] for a short file
/// with its pages, [`RegistryError::NoMagic`], [`RegistryError::ForeignSegment`],
/// [`RegistryError::VersionMismatch`], [`RegistryError::CreatorUnknown`]).
///
/// # Examples
/// ```
/// use cuda_ipc::registry::{Registry, RegistryOptions, inspect};
/// let name = format!("cuda-ipc-doc-abandoned-{}", std::process::id());
/// let reg = Registry::create(&name, &RegistryOptions::new().capacity(4))?;
/// assert_eq!(inspect::abandoned(&name)?, None); // finished: not a leftover
/// Registry::unlink(&name)?;
/// # Ok::<(), cuda_ipc::Error>(())
/// ```
pub fn abandoned(name: &str) -> Result<Option<&'static str>> {
    Ok(judged(name)?.map(|(why, _)| why))
}

/// [`segment::judge_leftover`](super::segment::judge_leftover) as [`abandoned`] answers (a
/// cleaner's judgement): why and the inode judged; a young creation, a live creator's or a name
/// changed meanwhile is `Ok(None)`.
pub(super) fn judged(name: &str) -> Result<Option<(&'static str, u64)>> {
    match super::segment::judge_leftover(name) {
        Ok(Leftover::Abandoned { why, inode, .. }) => Ok(Some((why, inode))),
        Ok(Leftover::Changed | Leftover::UnderWay(_)) => Ok(None),
        Err(Error::Shm(crate::shm::ShmError::NotFound { .. })) => Ok(None),
        Err(e) => Err(e),
    }
}

/// [`abandoned`] for `gc`'s scan, with a creation that may still be finished told apart (young,
/// or its creator runs: kept, not a problem) and a registry finished since the inspection looked
/// ([`Creation::Finished`]: inspect it again). The rule is [`abandoned`]'s; nothing waits.
///
/// # Errors
/// As [`abandoned`], and [`crate::shm::ShmError::NotFound`] when nothing is under the name.
pub(crate) fn judge_creation(name: &str) -> Result<Creation> {
    let judged = super::segment::judge_leftover(name)?;
    Ok(match judged {
        Leftover::Abandoned { why, .. } => Creation::Abandoned(why),
        Leftover::UnderWay(why) => Creation::UnderWay(why),
        Leftover::Changed => {
            // Gone, or finished, meanwhile: which of the two, the name says.
            crate::shm::Segment::stat(name)?;
            Creation::Finished
        }
    })
}

/// The `serde` forms of the snapshot fields whose JSON differs from the Rust value.
#[cfg(feature = "serde")]
mod json {
    use super::Record;
    use serde::{Serialize, Serializer};

    /// A record without its token and metadata bytes: their lengths, and the owner's pid.
    pub(super) fn record<S: Serializer>(r: &Record, s: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Json<'a> {
            name: &'a str,
            kind: u32,
            seq: u64,
            slot: u32,
            owner_pid: u32,
            token_bytes: usize,
            metadata_bytes: usize,
        }
        Json {
            name: &r.name,
            kind: r.kind,
            seq: r.seq,
            slot: r.slot,
            owner_pid: r.owner.pid,
            token_bytes: r.token.len(),
            metadata_bytes: r.metadata.len(),
        }
        .serialize(s)
    }

    /// `dead` written as `alive` (and `writer_dead` as `writer_alive`).
    pub(super) fn negated<S: Serializer>(b: &bool, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bool(!b)
    }

    /// `(slot, reason)` pairs as `{"slot": N, "reason": "..."}` objects.
    pub(super) fn corrupt_slots<S: Serializer>(
        v: &[(u32, String)],
        s: S,
    ) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Json<'a> {
            slot: u32,
            reason: &'a str,
        }
        s.collect_seq(v.iter().map(|(slot, reason)| Json {
            slot: *slot,
            reason,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::RegistryOptions;
    use crate::shm::Segment;
    use crate::shm::ShmError;

    /// The identity of a process that has exited (and was reaped).
    fn dead_identity() -> ProcessIdentity {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        let start_time = crate::identity::start_time_of(pid).unwrap().unwrap_or(1);
        child.wait().unwrap();
        ProcessIdentity {
            pid,
            start_time,
            ..ProcessIdentity::current().unwrap()
        }
    }

    #[test]
    fn inspect_lists_records_and_participants_without_joining() {
        let name = format!("cuda-ipc-test-inspect-{}", std::process::id());
        let reg =
            Registry::create(&name, &RegistryOptions::new().capacity(4).participants(4)).unwrap();
        reg.publish("a", 1, b"tok", b"m").unwrap();
        reg.publish("b", 2, b"", b"").unwrap();
        let s = inspect(&name).unwrap();
        assert_eq!((s.capacity, s.participant_capacity, s.last_seq), (4, 4, 2));
        assert_eq!(s.creator_pid, std::process::id());
        let names: Vec<_> = s.records.iter().map(|r| r.record.name.as_str()).collect();
        assert_eq!(names.len(), 2);
        assert!(names.contains(&"a") && names.contains(&"b"));
        assert!(
            s.records
                .iter()
                .all(|r| r.owner_liveness == Liveness::Alive)
        );
        assert_eq!(s.participants.len(), 1, "inspecting must not join");
        assert!(!s.participants[0].dead);
        assert!(s.locked_slots.is_empty() && s.corrupt_slots.is_empty());
        assert!(!s.has_leftovers());
        assert_eq!(inspect(&name).unwrap(), s, "inspecting changed nothing");
        assert!(list_registries().unwrap().contains(&name));
        Registry::unlink(&name).unwrap();
        assert!(!list_registries().unwrap().contains(&name));
        assert!(matches!(
            inspect(&name),
            Err(Error::Shm(ShmError::NotFound { .. }))
        ));
    }

    #[test]
    fn leftovers_of_a_dead_process_are_shown_and_match_what_reclaim_frees() {
        let name = format!("cuda-ipc-test-inspect-dead-{}", std::process::id());
        let opts = RegistryOptions::new().capacity(4).participants(4);
        let live = Registry::create(&name, &opts).unwrap();
        live.publish("live", 1, b"", b"").unwrap();
        // A handle that publishes as a process that has exited.
        let (seg, slots, parts) = match Registry::try_open(&name, false) {
            Ok(t) => t,
            Err(_) => panic!("open"),
        };
        let dead = Registry::attach(seg, slots, parts, dead_identity(), &opts).unwrap();
        dead.publish("orphan", 1, b"", b"").unwrap();
        let s = inspect(&name).unwrap();
        let orphan = s
            .records
            .iter()
            .find(|r| r.record.name == "orphan")
            .unwrap();
        assert_eq!(orphan.owner_liveness, Liveness::Dead);
        assert_eq!(s.participants.iter().filter(|p| p.dead).count(), 1);
        assert!(s.has_leftovers());
        std::mem::forget(dead); // its entry stays, as a dead process's would
        let rep = live.reclaim_dead().unwrap();
        assert_eq!((rep.records, rep.participants), (1, 1));
        let after = inspect(&name).unwrap();
        assert!(!after.has_leftovers());
        assert_eq!(after.records.len(), 1);
        Registry::unlink(&name).unwrap();
    }

    #[test]
    fn foreign_segments_are_refused() {
        let name = format!("cuda-ipc-test-inspect-foreign-{}", std::process::id());
        let seg = Segment::create(&name, 4096, &crate::shm::SegmentOptions::new()).unwrap();
        // SAFETY: 4096-byte mapping, page aligned; nobody else knows this segment.
        unsafe { (seg.as_ptr() as *mut u64).write_volatile(42) };
        let e = inspect(&name).unwrap_err().to_string();
        assert!(e.contains("not a cuda-ipc registry"), "{e}");
        assert!(!list_registries().unwrap().contains(&name));
        Segment::unlink(&name).unwrap();
    }
}
