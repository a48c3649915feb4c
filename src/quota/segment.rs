//! One open ledger segment: its entries, the ledger lock (an `F_OFD_SETLK` record lock and this
//! process's mutex) with the repair of what a killed locker left, the reclaim of dead holders, and
//! the judgement of what stands under a ledger's name. The public calls on it are in `ledger`.

use super::error::QuotaError;
use super::layout::{
    ENTRIES, ENTRIES_AT, ENTRY_LEN, Entry, FREE, HELD, Header, LOCK_OFFSET, UNLIMITED, VERSION,
};
use super::scope::QuotaScope;
use super::snapshot::Holder;
use crate::driver::Uuid;
use crate::error::{Error, OsError, Result};
use crate::identity::{Liveness, ProcessIdentity};
use crate::shm::versioned::{self, HeaderError, OpenError};
use crate::shm::{Segment, ShmError};
use crate::sync::Ordering;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long a change waits for the ledger lock held by a live process (a holder keeps it for
/// microseconds; a dead holder's lock is released by the kernel).
const LOCK_TIMEOUT: Duration = Duration::from_secs(2);

/// One open ledger segment, shared by a [`super::QuotaLedger`]'s clones.
pub(super) struct Inner {
    pub(super) seg: Segment,
    pub(super) device: Uuid,
    pub(super) scope: QuotaScope,
    /// Serialises this process's threads: the OFD lock belongs to the open file description, which
    /// they share, so it does not exclude them from one another.
    pub(super) local: Mutex<()>,
}

/// The ledger lock, held: the OFD record lock and this process's mutex.
pub(super) struct Locked<'a> {
    inner: &'a Inner,
    _local: MutexGuard<'a, ()>,
}

fn flock(kind: libc::c_int) -> libc::flock {
    // SAFETY: `flock` is a plain C struct of integers; all-zero is a valid value.
    let mut l: libc::flock = unsafe { std::mem::zeroed() };
    l.l_type = kind as libc::c_short;
    l.l_whence = libc::SEEK_SET as libc::c_short;
    l.l_start = LOCK_OFFSET;
    l.l_len = 1;
    l
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        use rustix::fd::AsRawFd;
        let l = flock(libc::F_UNLCK);
        // SAFETY: the segment's fd is open while `inner` lives; `l` is a valid flock that
        // outlives the call. Unlocking a lock we hold cannot fail but for a bad fd.
        let _ = unsafe { libc::fcntl(self.inner.seg.fd().as_raw_fd(), libc::F_OFD_SETLK, &l) };
    }
}

impl Inner {
    pub(super) fn header(&self) -> &Header {
        versioned::header::<Header>(&self.seg)
    }

    pub(super) fn entry(&self, i: u32) -> &Entry {
        debug_assert!(i < ENTRIES);
        // (1) The mapping is at least LEDGER_LEN bytes (every opener and creator checks it), so
        // entry `i < ENTRIES` lies inside it, and it lives as long as `self`; the file still
        // backs it (`lock` checks it, and every access is made under the lock: a cut after that
        // check, by another member of a group ledger's group, is the residue
        // `Segment::check_intact` names); (2) the offset is a multiple of 128 from a page, so
        // Entry's 8-byte alignment holds.
        // SAFETY: (1), (2); (3) Entry is `repr(C)` atomics only: every bit pattern is valid and
        // a shared reference permits other processes' concurrent writes.
        unsafe {
            &*self
                .seg
                .as_ptr()
                .add(ENTRIES_AT + i as usize * ENTRY_LEN)
                .cast::<Entry>()
        }
    }

    pub(super) fn name(&self) -> &str {
        self.seg.name()
    }

    /// Takes the ledger lock (at most [`LOCK_TIMEOUT`]), checks that the segment still holds
    /// every byte mapped ([`Segment::check_intact`]), then repairs what a locker killed half-way
    /// left: `WRITING` entries (and states no build writes) are freed. Every read and write of the
    /// header's counters and the entries after the open is made under this lock, so after this
    /// check.
    ///
    /// # Errors
    /// [`crate::Error::Timeout`] when a live process holds the lock for [`LOCK_TIMEOUT`];
    /// [`ShmError::Shrunk`] when the ledger was cut short under this mapping (nothing read or
    /// written); [`crate::Error::Os`] when `fcntl` or `fstat` fails.
    pub(super) fn lock(&self) -> Result<Locked<'_>> {
        use rustix::fd::AsRawFd;
        let local = self.local.lock().unwrap_or_else(|p| p.into_inner());
        let l = flock(libc::F_WRLCK);
        let deadline = Instant::now() + LOCK_TIMEOUT;
        let mut pause = Duration::from_micros(50);
        loop {
            // SYNC POINT ledger lock: the kernel's record lock orders one locker's critical section
            // after the previous one's (the lock and unlock calls are full barriers); the atomics
            // inside are Release/Acquire pairs of their own (SYNC POINT entry) on top of it.
            // SAFETY: the segment's fd is open while `self` lives; `l` is a valid flock that
            // outlives the call.
            let r = unsafe { libc::fcntl(self.seg.fd().as_raw_fd(), libc::F_OFD_SETLK, &l) };
            if r == 0 {
                break;
            }
            let e = std::io::Error::last_os_error();
            if !matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EACCES)) {
                return Err(
                    OsError::io("fcntl(F_OFD_SETLK)", format!("/{}", self.name()), e).into(),
                );
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    what: "the quota ledger's lock",
                    after: LOCK_TIMEOUT,
                });
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(2));
        }
        let g = Locked {
            inner: self,
            _local: local,
        };
        // Before any word is touched: still every byte mapped (a group ledger is 0660, so any
        // member of the group can cut it short under this mapping, where a touch past the new end
        // would raise SIGBUS). Refused here (the lock goes back with `g`), never read or written.
        self.seg.check_intact()?;
        let mut repaired = 0;
        for i in 0..ENTRIES {
            let e = self.entry(i);
            // SYNC POINT entry: Acquire, pairs with the Release stores of `state` in `reserve`
            // and `free`.
            let s = e.state.load(Ordering::Acquire);
            if s != FREE && s != HELD {
                // WRITING under a free lock: its writer died before it returned the reservation.
                e.state.store(FREE, Ordering::Release);
                repaired += 1;
            }
        }
        if repaired > 0 {
            tracing::warn!(
                "quota ledger {}: freed {repaired} entries a holder left half-written",
                self.name()
            );
            self.store_used();
        }
        Ok(g)
    }

    /// The entries of dead holders (under the lock), each with where its bytes still are: a dead
    /// holder whose host memory is still in `/dev/shm` ([`Inner::memory_left`]) keeps its entry
    /// (its bytes stay counted until that segment is removed: `cuda-ipc gc`, or a successor
    /// replacing it); the others are freed when `free`. Returns every dead holder.
    pub(super) fn reclaim_dead(&self, _g: &Locked<'_>, free: bool) -> Vec<Dead> {
        let mut dead = Vec::new();
        for i in 0..ENTRIES {
            let e = self.entry(i);
            // SYNC POINT entry: Acquire, as in `lock`.
            if e.state.load(Ordering::Acquire) != HELD {
                continue;
            }
            // Relaxed: ordered by the Acquire load of `state`.
            let id = ProcessIdentity::load_words(&e.identity);
            let uid = e.uid.load(Ordering::Relaxed) as u32;
            // The holder's liveness file counts only if the holder's uid (or root) owns it.
            if id.liveness_as(uid) != Liveness::Dead {
                continue;
            }
            dead.push(Dead {
                index: i,
                // Relaxed: under the lock, as the fields above.
                memory_name: e.memory_name.load(Ordering::Relaxed),
                memory_inode: e.memory_inode.load(Ordering::Relaxed),
                holder: Holder {
                    identity: id,
                    uid,
                    bytes: e.bytes.load(Ordering::Relaxed),
                    liveness: Liveness::Dead,
                    left_in: None,
                },
            });
        }
        self.memory_left(&mut dead);
        let mut freed = false;
        for d in dead.iter().filter(|d| d.holder.left_in.is_none()) {
            if !free {
                break;
            }
            tracing::info!(
                "quota ledger {}: reclaimed {} of dead pid {} (pid ns {})",
                self.name(),
                crate::error::bytes(d.holder.bytes),
                d.holder.identity.pid,
                d.holder.identity.pid_ns
            );
            // SYNC POINT entry: Release, pairs with the Acquire loads of `state`.
            self.entry(d.index).state.store(FREE, Ordering::Release);
            freed = true;
        }
        if freed {
            self.store_used();
        }
        dead
    }

    /// Sets each dead holder's `left_in`: the `/dev/shm` name of the segment that holds its bytes,
    /// while it stands there. For an entry that recorded its segment
    /// ([`super::Reservation::record_memory`]): the file of the recorded inode whose name has the
    /// recorded hash. For one that named the segment at its reserve but died before it recorded
    /// it (made, or not yet made): a file whose name has that hash and whose inode no entry of the
    /// ledger recorded (a successor's segment of that name, recorded, is not the dead one's).
    /// `None` where no segment was named (GPU memory, which the driver frees with its process) or
    /// that file is gone (removed, or replaced under its name). One pass over `/dev/shm`, only
    /// when a dead entry named a segment; every name in it is hashed only when one died before
    /// recording its segment.
    fn memory_left(&self, dead: &mut [Dead]) {
        let recorded: Vec<(u64, u64)> = dead
            .iter()
            .filter(|d| d.memory_inode != 0 && d.memory_name != 0)
            .map(|d| (d.memory_inode, d.memory_name))
            .collect();
        let pending: Vec<u64> = dead
            .iter()
            .filter(|d| d.memory_inode == 0 && d.memory_name != 0)
            .map(|d| d.memory_name)
            .collect();
        if recorded.is_empty() && pending.is_empty() {
            return;
        }
        let found = crate::shm::names_of_inodes(|inode, name| {
            (!pending.is_empty() && pending.contains(&name_hash(name)))
                || recorded
                    .iter()
                    .any(|(i, h)| *i == inode && *h == name_hash(name))
        });
        // Each found name hashed once (a dead entry per found name at most, but 256 of them).
        let found: Vec<(u64, u64, String)> = found
            .into_iter()
            .map(|(inode, name)| (inode, name_hash(&name), name))
            .collect();
        // The inodes every held entry recorded (live or dead), for the entries that recorded none.
        let claimed: Vec<u64> = if pending.is_empty() {
            Vec::new()
        } else {
            (0..ENTRIES)
                .map(|i| self.entry(i))
                // SYNC POINT entry: Acquire, as in `lock`; the inode is Relaxed after it.
                .filter(|e| e.state.load(Ordering::Acquire) == HELD)
                .map(|e| e.memory_inode.load(Ordering::Relaxed))
                .filter(|i| *i != 0)
                .collect()
        };
        for d in dead.iter_mut() {
            d.holder.left_in = found
                .iter()
                .find(|(inode, hash, _)| {
                    *hash == d.memory_name
                        && if d.memory_inode != 0 {
                            *inode == d.memory_inode
                        } else {
                            !claimed.contains(inode)
                        }
                })
                .map(|(.., name)| name.clone());
        }
    }

    /// The held entries: (index, identity, uid, bytes).
    pub(super) fn held(&self) -> Vec<(u32, ProcessIdentity, u32, u64)> {
        (0..ENTRIES)
            .filter_map(|i| {
                let e = self.entry(i);
                // SYNC POINT entry: Acquire, as in `lock`; the loads below are Relaxed.
                (e.state.load(Ordering::Acquire) == HELD).then(|| {
                    (
                        i,
                        ProcessIdentity::load_words(&e.identity),
                        e.uid.load(Ordering::Relaxed) as u32,
                        e.bytes.load(Ordering::Relaxed),
                    )
                })
            })
            .collect()
    }

    /// Rewrites the header's copy of the bytes in use and bumps the change counter.
    pub(super) fn store_used(&self) -> u64 {
        let used = self
            .held()
            .iter()
            .fold(0u64, |a, (_, _, _, b)| a.saturating_add(*b));
        let h = self.header();
        // Relaxed: written under the lock; readers take the lock too (tools' snapshots).
        h.used.store(used, Ordering::Relaxed);
        h.changes.fetch_add(1, Ordering::Relaxed);
        used
    }

    pub(super) fn budget(&self) -> Option<u64> {
        // Relaxed: written and read under the lock.
        let b = self.header().budget.load(Ordering::Relaxed);
        (b != UNLIMITED).then_some(b)
    }
}

/// A dead holder's entry as [`Inner::reclaim_dead`] found it.
pub(super) struct Dead {
    /// The entry's index.
    pub(super) index: u32,
    /// The entry's [`name_hash`] of its memory's segment (0: none recorded).
    pub(super) memory_name: u64,
    /// The entry's inode of its memory's segment (0: none recorded).
    pub(super) memory_inode: u64,
    /// The holder, with `left_in` set while its memory stays in `/dev/shm` (the entry is kept).
    pub(super) holder: Holder,
}

/// The hash an entry keeps of the `/dev/shm` name of the segment holding its bytes: the first 8
/// bytes of the name's SHA-256, little-endian; never 0 (0 means none recorded).
pub(super) fn name_hash(name: &str) -> u64 {
    use sha2::Digest as _;
    let d = sha2::Sha256::digest(name.as_bytes());
    let mut w = [0u8; 8];
    w.copy_from_slice(&d[..8]);
    u64::from_le_bytes(w).max(1)
}

/// What stands under a ledger's name that is not (yet) a ready ledger, by the one rule of
/// [`judge_creation`]: what a creator replaces ([`judge_blocker`]) and `gc` removes
/// ([`super::remove_abandoned`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Creation {
    /// This user's creation abandoned half-way: why, the inode judged (removed only while the name
    /// still stands for it), and the creator where one is recorded (and dead).
    Abandoned {
        why: &'static str,
        inode: u64,
        creator: Option<ProcessIdentity>,
    },
    /// Empty or sparse, younger than [`versioned::ABANDONED_AFTER`] or its sizing lock held (a
    /// creator may be sizing it now), or the name changed while it was judged: look again shortly.
    Sizing,
    /// Sized but not stamped yet, and it may still be finished: why, in words (younger than
    /// [`versioned::ABANDONED_AFTER`], or its creator runs or cannot be told dead).
    Unfinished(String),
    /// No creation under way: stamped, or a header no ledger creator writes (another magic, a bad
    /// stamp word); opening it says what it is.
    Finished,
}

/// Judges what stands under the ledger name `name` as a creation: only this user's segment is
/// ever [`Creation::Abandoned`], and of those only one that is
/// - empty (a creator killed before `ftruncate`) or sparse (before `fallocate`), at least
///   [`versioned::ABANDONED_AFTER`] (2 s) old with its sizing lock free
///   ([`versioned::stat_blocker`]): no creator is recorded there, so none can be alive;
/// - sized, never stamped, at least as old, and its header not begun (magic 0) or its recorded
///   creator dead by [`ProcessIdentity::liveness_as`] with the file owner's uid (the creator made
///   the file). A creator whose liveness cannot be told keeps it ([`Creation::Unfinished`]).
///
/// Reads the file's status, then maps it and loads its header words; changes nothing, sleeps
/// nowhere.
///
/// # Errors
/// What is under the name when it is no creation of ours, and why it is kept:
/// [`ShmError::NotFound`] when there is nothing, [`ShmError::WrongOwner`] for another user's
/// segment, [`ShmError::InsecureMode`] for one open to other users (any of the mode bits
/// `0o007`), [`ShmError::NotASegment`] for a FIFO, directory, socket or device (never opened in a
/// way that could block), [`ShmError::TooSmall`] for a short file whose pages are there,
/// [`crate::Error::Os`] when a call fails.
pub(crate) fn judge_creation(name: &str) -> Result<Creation> {
    let judged = Segment::stat(name)?;
    let info = match versioned::stat_blocker(name, ENTRIES_AT)? {
        versioned::Blocker::Abandoned => {
            return Ok(Creation::Abandoned {
                why: versioned::ABANDONED_UNSIZED,
                inode: judged.inode,
                creator: None,
            });
        }
        versioned::Blocker::Young => return Ok(Creation::Sizing),
        versioned::Blocker::Sized(info) => info,
    };
    // The header page only: its words are all this judgement reads.
    let seg = Segment::open_with_min_len(name, ENTRIES_AT)?;
    seg.check_owner()?;
    if info.inode != judged.inode || seg.inode()? != judged.inode {
        // Made again while judged: its creator may be at work.
        return Ok(Creation::Sizing);
    }
    let h = versioned::header::<Header>(&seg);
    if versioned::look(h) != versioned::Look::Unstamped {
        return Ok(Creation::Finished);
    }
    if info.age_secs < versioned::ABANDONED_AFTER.as_secs() {
        return Ok(Creation::Unfinished(
            "a creation under way: not stamped yet, younger than 2 s".to_string(),
        ));
    }
    // SYNC POINT creator: Acquire, pairs with the Release store of the magic in
    // `write_versioned`: a creator that stored the magic stored its identity before it.
    let magic = h.magic.load(Ordering::Acquire);
    if magic == 0 {
        // Pages reserved, header not begun: a live creator stores its magic microseconds after
        // `fallocate`; no creator is recorded yet.
        return Ok(Creation::Abandoned {
            why: "a creation abandoned before its header was written",
            inode: judged.inode,
            creator: None,
        });
    }
    // Relaxed: ordered by the Acquire above (SYNC POINT creator).
    let creator = ProcessIdentity::load_words(&h.creator);
    // The creator made the file, so its owner is the creator's uid.
    Ok(match creator.liveness_as(info.uid) {
        Liveness::Dead => Creation::Abandoned {
            why: "a creation abandoned by its dead creator before its init stamp",
            inode: judged.inode,
            creator: Some(creator),
        },
        Liveness::Alive => Creation::Unfinished(format!(
            "a creation under way: not stamped yet, by {creator}, which runs"
        )),
        _ => Creation::Unfinished(format!(
            "a creation not stamped yet, by {creator}, whose liveness cannot be told from here"
        )),
    })
}

/// Whether what stands under a ledger's name may be replaced by a creator, by the rule of
/// [`judge_creation`]: `Ok(Some(why))` for this user's creation abandoned half-way; `Ok(None)`
/// after a short pause (5 ms) while a creator may be sizing it, or when the name went away: look
/// again. A ledger that is ready, or being created by a live process, is
/// [`ShmError::AlreadyExists`] (the caller opens it); anything else keeps the error that says what
/// it is (another user's, a FIFO, too small), and nothing of it is removed.
pub(super) fn judge_blocker(name: &str) -> Result<Option<&'static str>> {
    match judge_creation(name) {
        Ok(Creation::Abandoned { why, .. }) => Ok(Some(why)),
        Ok(Creation::Sizing) => {
            // A creator is sizing it now: look again shortly.
            std::thread::sleep(Duration::from_millis(5));
            Ok(None)
        }
        Ok(Creation::Unfinished(_) | Creation::Finished) => Err(ShmError::AlreadyExists {
            name: name.to_string(),
        }
        .into()),
        Err(Error::Shm(ShmError::NotFound { .. })) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Maps what the versioned opener found to this layer's errors.
pub(super) fn open_error(name: &str, e: OpenError) -> Error {
    match e {
        OpenError::Segment(e) => e,
        OpenError::Header(HeaderError::Foreign { magic }) => QuotaError::BadSegment {
            name: name.to_string(),
            reason: format!("magic {magic:#018x}, not a quota ledger's (CIPCQUOT)"),
        }
        .into(),
        OpenError::Header(HeaderError::OtherVersion { found }) => QuotaError::VersionMismatch {
            name: name.to_string(),
            found,
            supported: VERSION,
        }
        .into(),
        OpenError::Header(HeaderError::BadStamp { found }) => QuotaError::BadSegment {
            name: name.to_string(),
            reason: format!("init stamp word {found:#x}"),
        }
        .into(),
        OpenError::Header(HeaderError::Unstamped { waited }) => QuotaError::BadSegment {
            name: name.to_string(),
            reason: format!("never initialised (no init stamp after {waited:?})"),
        }
        .into(),
        // (The ledger's opener waits by its own rule: `open_versioned`, never these three.)
        OpenError::Header(HeaderError::Overwritten { waited }) => QuotaError::BadSegment {
            name: name.to_string(),
            reason: format!(
                "no init stamp after {waited:?} though its creator runs: the header was overwritten"
            ),
        }
        .into(),
        OpenError::Header(HeaderError::InUse) => QuotaError::BadSegment {
            name: name.to_string(),
            reason: "no init stamp in a ledger in use: the header was overwritten".to_string(),
        }
        .into(),
        OpenError::Header(HeaderError::Abandoned) => QuotaError::BadSegment {
            name: name.to_string(),
            reason: "never initialised (no init stamp, and its creator is gone)".to_string(),
        }
        .into(),
    }
}
