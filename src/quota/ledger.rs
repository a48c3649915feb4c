//! The ledger's public calls: create, open, set the budget, reserve, release, inspect, remove
//! (module doc of [`crate::quota`] for the rules, `segment` for the lock, the repair and the
//! reclaim, `layout` for the bytes).

use super::error::{HeldBy, QuotaError};
use super::layout::{ENTRIES, FREE, HELD, Header, LEDGER_LEN, SCOPE_GROUP, SCOPE_USER, WRITING};
use super::scope::{LEDGER_PREFIX, QuotaScope, check_planted};
use super::segment::{Creation, Inner, judge_blocker, judge_creation, name_hash, open_error};
use super::snapshot::{Holder, LedgerSnapshot};
use crate::driver::Uuid;
use crate::error::{Error, Result};
use crate::identity::ForkEpoch;
use crate::identity::ProcessIdentity;
use crate::shm::versioned;
use crate::shm::{Segment, SegmentOptions, ShmError};
use crate::sync::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long an opener waits for the init stamp of a ledger being created.
const OPEN_WAIT: Duration = Duration::from_secs(1);

/// Points in a reservation where a test may stop the process (its parent then kills it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum QuotaTestPoint {
    /// The ledger lock is held and an entry is `WRITING` with half its fields stored.
    EntryHalfWritten,
}

static TEST_HOOK: std::sync::OnceLock<fn(QuotaTestPoint)> = std::sync::OnceLock::new();

/// Installs a function called at every [`QuotaTestPoint`] this process reaches (once per process;
/// later calls are ignored). For tests that kill a holder at the worst moment.
pub fn set_test_hook(hook: fn(QuotaTestPoint)) {
    let _ = TEST_HOOK.set(hook);
}

fn test_point(p: QuotaTestPoint) {
    if let Some(h) = TEST_HOOK.get() {
        h(p);
    }
}

/// A handle on one device's quota ledger (module doc of [`crate::quota`]). Cheap to clone; every
/// clone shares one open segment.
#[derive(Clone)]
pub struct QuotaLedger {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for QuotaLedger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuotaLedger")
            .field("name", &self.inner.seg.name())
            .finish_non_exhaustive()
    }
}

/// Bytes held from a ledger until this is dropped (or [`Reservation::release`]d). A process that
/// dies holding one loses it at the next reserve or inspection of the ledger, or, where its bytes
/// live in a `/dev/shm` segment it recorded ([`Reservation::record_memory`]), at the first one
/// after that segment is gone.
#[derive(Debug)]
pub struct Reservation {
    ledger: QuotaLedger,
    index: u32,
    id: u64,
    bytes: u64,
    released: bool,
    /// The process (by fork) that reserved it: a forked child's copy never frees its parent's
    /// entry (`identity::fork`; a pid does not tell them apart across pid namespaces).
    fork: ForkEpoch,
}

impl QuotaLedger {
    /// Opens the ledger of `scope` for `device` (all-zero UUID: host memory), waiting up to 1 s for
    /// a creator that is still writing it.
    ///
    /// # Errors
    /// [`crate::Error::Shm`] as the segment reports it: `NotFound` (no budget was set for this
    /// device and scope), `WrongOwner` (another user's ledger, or a group ledger of a group we are
    /// not in), `InsecureMode`, `NotASegment` (a FIFO, directory or socket under the name: never
    /// read, never removed), `TooSmall`, `Sparse`; [`QuotaError::BadSegment`] for a foreign,
    /// garbled or never initialised ledger or one that names another device or scope than its
    /// name; [`QuotaError::VersionMismatch`].
    pub fn open(scope: QuotaScope, device: Uuid) -> Result<QuotaLedger> {
        let name = scope.segment_name(device);
        let l = Self::open_named(&name)?;
        if l.inner.scope != scope || l.inner.device != device {
            return Err(QuotaError::BadSegment {
                name,
                reason: format!("its header names {} on {}", l.inner.scope, l.inner.device),
            }
            .into());
        }
        Ok(l)
    }

    /// Opens a ledger by its segment name (`cuda-ipc.quota.…`, as [`list_ledgers`] gives), for
    /// tools. Group ledgers (`cuda-ipc.quota.g…`) are accepted from another user of one of our
    /// groups.
    ///
    /// # Errors
    /// As [`QuotaLedger::open`]; [`QuotaError::BadSegment`] also when the header's scope and
    /// device give another name than `name`.
    pub fn open_named(name: &str) -> Result<QuotaLedger> {
        check_planted(name)?;
        let group = name.starts_with(&format!("{LEDGER_PREFIX}g"));
        let seg = versioned::open_versioned::<Header>(name, group, OPEN_WAIT)
            .map_err(|e| open_error(name, e))?;
        // Its version is this build's: the entries must all be there before one is read.
        if seg.len() < LEDGER_LEN {
            return Err(ShmError::TooSmall {
                name: name.to_string(),
                len: seg.len() as u64,
                min: LEDGER_LEN as u64,
            }
            .into());
        }
        let h = versioned::header::<Header>(&seg);
        let bad = |reason: String| -> Error {
            QuotaError::BadSegment {
                name: name.to_string(),
                reason,
            }
            .into()
        };
        // Relaxed: ordered by the Acquire load of the stamp in `open_versioned`.
        let entries = h.entries.load(Ordering::Relaxed);
        if entries != ENTRIES {
            return Err(bad(format!("{entries} entries, not {ENTRIES}")));
        }
        let scope = match (
            h.scope.load(Ordering::Relaxed),
            h.scope_id.load(Ordering::Relaxed),
        ) {
            (SCOPE_USER, u) => QuotaScope::User(u),
            (SCOPE_GROUP, g) => QuotaScope::Group(g),
            (s, _) => return Err(bad(format!("scope word {s}"))),
        };
        let mut dev = [0u8; 16];
        dev[..8].copy_from_slice(&h.device[0].load(Ordering::Relaxed).to_le_bytes());
        dev[8..].copy_from_slice(&h.device[1].load(Ordering::Relaxed).to_le_bytes());
        let device = Uuid(dev);
        let (_, gid, _) = seg.owner()?;
        if let QuotaScope::Group(g) = scope
            && gid != g
        {
            return Err(bad(format!(
                "a ledger of gid {g} whose file belongs to gid {gid}"
            )));
        }
        if scope.segment_name(device) != name {
            return Err(bad(format!("its header names {scope} on {device}")));
        }
        Ok(QuotaLedger {
            inner: Arc::new(Inner {
                seg,
                device,
                scope,
                local: Mutex::new(()),
            }),
        })
    }

    /// Sets the budget of `scope` on `device` to `budget` bytes ([`UNLIMITED`](super::UNLIMITED): no limit),
    /// creating the ledger when there is none (mode `0600` for a user, `0660` with the group set
    /// for a group). Reservations already held stay; only new ones are judged by the new budget.
    ///
    /// # Errors
    /// [`QuotaError::NotBudgetOwner`] when the ledger exists and is not this uid's (and we are not
    /// root); [`QuotaError::BadGroup`] when the group cannot be given to the file; the errors of
    /// [`QuotaLedger::open`] for what stands under the name; [`crate::Error::Timeout`] when a live
    /// process holds the ledger lock for 2 s; [`ShmError::Shrunk`] when the ledger was cut short
    /// right after its open; [`crate::Error::Os`] and `NoSpace` from creating it.
    pub fn set_budget(scope: QuotaScope, device: Uuid, budget: u64) -> Result<QuotaLedger> {
        let name = scope.segment_name(device);
        check_planted(&name)?;
        let ledger = match Self::create(scope, device, budget) {
            Ok(l) => return Ok(l),
            Err(Error::Shm(ShmError::AlreadyExists { .. })) => Self::open(scope, device)?,
            // Another member's group ledger (the creation refuses to judge a file not ours): it
            // is opened as a member may, and refused below by who owns it.
            Err(Error::Shm(ShmError::WrongOwner { .. }))
                if matches!(scope, QuotaScope::Group(_)) =>
            {
                Self::open(scope, device)?
            }
            Err(e) => return Err(e),
        };
        check_budget_owner(&ledger.inner.seg)?;
        let _g = ledger.inner.lock()?;
        let h = ledger.inner.header();
        // Relaxed: under the lock (SYNC POINT ledger lock).
        h.budget.store(budget, Ordering::Relaxed);
        h.changes.fetch_add(1, Ordering::Relaxed);
        drop(_g);
        Ok(ledger)
    }

    /// Creates the ledger (`O_EXCL`); `AlreadyExists` when the name is taken by anything but a
    /// creation of this user abandoned half-way (which is replaced: [`judge_blocker`]).
    fn create(scope: QuotaScope, device: Uuid, budget: u64) -> Result<QuotaLedger> {
        let name = scope.segment_name(device);
        let group = matches!(scope, QuotaScope::Group(_));
        // Before the segment is made: the first call of a process creates its liveness file, whose
        // failure (a full /dev/shm) must not leave the new segment behind.
        let me = ProcessIdentity::current()?;
        let seg = versioned::create_replacing(
            &name,
            LEDGER_LEN,
            &SegmentOptions::new().group_access(group),
            "quota ledger",
            || judge_blocker(&name),
        )?;
        if let QuotaScope::Group(gid) = scope {
            let r = rustix::fs::fchown(seg.fd(), None, Some(rustix::fs::Gid::from_raw(gid)));
            if let Err(e) = r {
                // Ours, just made and never stamped: take it away again.
                let _ = Segment::unlink(&name);
                return Err(QuotaError::BadGroup {
                    group: gid.to_string(),
                    reason: format!("cannot give the ledger to gid {gid}: {e}"),
                }
                .into());
            }
        }
        let (scope_word, scope_id) = scope.words();
        versioned::write_versioned::<Header>(
            &seg,
            // Relaxed stores, published by the magic's and the stamp's Release in
            // `write_versioned` (SYNC POINT creator, stamp).
            |h| me.store_words(&h.creator),
            |h| {
                h.budget.store(budget, Ordering::Relaxed);
                h.used.store(0, Ordering::Relaxed);
                h.entries.store(ENTRIES, Ordering::Relaxed);
                h.scope.store(scope_word, Ordering::Relaxed);
                h.scope_id.store(scope_id, Ordering::Relaxed);
                let d = device.0;
                h.device[0].store(
                    u64::from_le_bytes(d[..8].try_into().unwrap_or_default()),
                    Ordering::Relaxed,
                );
                h.device[1].store(
                    u64::from_le_bytes(d[8..].try_into().unwrap_or_default()),
                    Ordering::Relaxed,
                );
            },
        );
        Ok(QuotaLedger {
            inner: Arc::new(Inner {
                seg,
                device,
                scope,
                local: Mutex::new(()),
            }),
        })
    }

    /// Removes the ledger's name (only while it is still this segment), for its owner; holders
    /// keep their mappings, new producers find no budget.
    ///
    /// # Errors
    /// [`QuotaError::NotBudgetOwner`] when it is not this uid's (and we are not root); the errors
    /// of `Segment::unlink_if_same`.
    pub fn remove(&self) -> Result<bool> {
        check_budget_owner(&self.inner.seg)?;
        Segment::unlink_if_same(self.name(), self.inner.seg.inode()?)
    }

    /// Removes the ledger of `scope` for `device` (all-zero UUID: host memory), for its owner or
    /// root, as [`QuotaLedger::remove`] does, and also one of another layout version, which this
    /// build cannot open (a ledger an older build made): that one is judged by its header's magic
    /// and version alone, its entries never read, and removed only while its name still stands
    /// for the file judged. Its holders keep their mappings; new producers find no budget.
    /// Returns whether a ledger was removed (`false`: none stood under the name, or it went
    /// meanwhile).
    ///
    /// # Errors
    /// [`QuotaError::NotBudgetOwner`] for another user's (and we are not root); the errors of
    /// [`QuotaLedger::open`] but `NotFound` and `VersionMismatch`.
    pub fn remove_of(scope: QuotaScope, device: Uuid) -> Result<bool> {
        let name = scope.segment_name(device);
        match Self::open(scope, device) {
            Ok(l) => l.remove(),
            Err(Error::Shm(ShmError::NotFound { .. })) => Ok(false),
            Err(Error::Quota(QuotaError::VersionMismatch { .. })) => {
                let seg = Segment::open_with_min_len(&name, super::layout::ENTRIES_AT)?;
                check_budget_owner(&seg)?;
                // Still our magic and another version (the name may stand for another file by
                // now): the first 12 bytes, read as the versioned header's words, while the file
                // still backs the mapping (a group member may cut a group ledger short).
                seg.check_intact()?;
                let h = versioned::header::<Header>(&seg);
                // Relaxed: a look at words this build never writes in a ledger of another version.
                if h.magic.load(Ordering::Relaxed) != super::layout::MAGIC
                    || h.version.load(Ordering::Relaxed) == super::layout::VERSION
                {
                    // Made again meanwhile: what stands now is judged as a ledger.
                    return Self::open(scope, device)?.remove();
                }
                Segment::unlink_if_same(&name, seg.inode()?)
            }
            Err(e) => Err(e),
        }
    }

    /// The segment's name in `/dev/shm`.
    pub fn name(&self) -> &str {
        self.inner.name()
    }

    /// The device whose budget this is.
    pub fn device(&self) -> Uuid {
        self.inner.device
    }

    /// Whose budget this is.
    pub fn scope(&self) -> QuotaScope {
        self.inner.scope
    }

    /// Reserves `bytes` for this process: under the ledger lock, frees the entries of dead holders
    /// whose memory is gone, then takes an entry when the held bytes plus `bytes` stay within the
    /// budget. As [`QuotaLedger::reserve_for`] with no segment named.
    ///
    /// # Errors
    /// [`QuotaError::OverQuota`] naming the budget, the bytes in use and each holder;
    /// [`QuotaError::Full`] when all 256 entries are held; [`crate::Error::InvalidArgument`] for 0
    /// bytes; [`crate::Error::Timeout`] when a live process holds the lock for 2 s;
    /// [`ShmError::Shrunk`] when the ledger was cut short under this mapping (as another member of
    /// a group ledger's group may: nothing is read or written);
    /// [`crate::Error::Os`] when this process's identity cannot be read.
    pub fn reserve(&self, bytes: u64) -> Result<Reservation> {
        self.reserve_for(bytes, None)
    }

    /// Reserves `bytes` for this process, for memory that will live in the `/dev/shm` segment
    /// `segment` (host memory; its name is recorded now, and its inode with
    /// [`Reservation::record_memory`] once made: should this process die in between, a file of
    /// that name whose inode no entry recorded counts as its memory). A dead
    /// holder whose recorded segment is still in `/dev/shm` keeps its entry (host memory does not
    /// go with its process); one whose segment has the name `segment` is not counted against this
    /// reservation, since making `segment` replaces it (a producer started again after a crash
    /// under its old name).
    ///
    /// # Errors
    /// As [`QuotaLedger::reserve`].
    pub fn reserve_for(&self, bytes: u64, segment: Option<&str>) -> Result<Reservation> {
        if bytes == 0 {
            return Err(Error::InvalidArgument("a reservation of 0 bytes".into()));
        }
        let me = ProcessIdentity::current()?;
        let uid = rustix::process::geteuid().as_raw();
        let inner = &*self.inner;
        let g = inner.lock()?;
        let dead = inner.reclaim_dead(&g, true);
        // A dead holder's memory under the name this reservation's segment will take is replaced
        // by that segment: it is not counted twice.
        let replaced: Vec<u32> = segment
            .map(|s| {
                let h = name_hash(s);
                dead.iter()
                    .filter(|d| d.holder.left_in.is_some() && d.memory_name == h)
                    .map(|d| d.index)
                    .collect()
            })
            .unwrap_or_default();
        let (replaced_held, held): (Vec<_>, Vec<_>) = inner
            .held()
            .into_iter()
            .partition(|h| replaced.contains(&h.0));
        let used = held.iter().fold(0u64, |a, h| a.saturating_add(h.3));
        let held_by = |(i, id, uid, b): &(u32, ProcessIdentity, u32, u64)| HeldBy {
            pid: id.pid,
            pid_ns: id.pid_ns,
            uid: *uid,
            bytes: *b,
            left_in: dead
                .iter()
                .find(|d| d.index == *i)
                .and_then(|d| d.holder.left_in.clone()),
        };
        if let Some(budget) = inner.budget()
            && used.checked_add(bytes).is_none_or(|t| t > budget)
        {
            return Err(QuotaError::OverQuota {
                device: inner.device,
                asked: bytes,
                budget,
                used,
                holders: held.iter().map(held_by).collect(),
                replaced: replaced_held.iter().map(held_by).collect(),
            }
            .into());
        }
        // A free entry, else that of a dead holder whose segment this reservation's replaces (its
        // bytes are not counted above, and its memory goes with the replacement).
        let free = (0..ENTRIES).find(|i| {
            // Relaxed: under the lock, where only we write.
            inner.entry(*i).state.load(Ordering::Relaxed) == FREE
        });
        let Some(index) = free.or_else(|| replaced.first().copied()) else {
            return Err(QuotaError::Full {
                name: inner.name().to_string(),
                entries: ENTRIES,
            }
            .into());
        };
        let id = versioned::new_generation();
        let e = inner.entry(index);
        // SYNC POINT entry: Release, pairs with the Acquire loads of `state` (the next locker's
        // repair): WRITING is seen before any field below.
        e.state.store(WRITING, Ordering::Release);
        // Relaxed: published by the Release store of HELD below.
        me.store_words(&e.identity);
        e.bytes.store(bytes, Ordering::Relaxed);
        test_point(QuotaTestPoint::EntryHalfWritten);
        e.id.store(id, Ordering::Relaxed);
        e.uid.store(u64::from(uid), Ordering::Relaxed);
        // The segment's name now, its inode once it is made (`record_memory`): a holder killed
        // in between is judged by the name alone (`Inner::memory_left`).
        e.memory_inode.store(0, Ordering::Relaxed);
        e.memory_name
            .store(segment.map_or(0, name_hash), Ordering::Relaxed);
        // SYNC POINT entry: Release, pairs with the Acquire loads of `state` in `held`,
        // `reclaim_dead` and `lock`: whoever sees HELD sees the fields above.
        e.state.store(HELD, Ordering::Release);
        inner.store_used();
        drop(g);
        Ok(Reservation {
            ledger: self.clone(),
            index,
            id,
            bytes,
            released: false,
            fork: ForkEpoch::now(),
        })
    }

    /// The ledger's state, after freeing the entries of dead holders whose memory is gone (so a
    /// killed producer's GPU bytes show as free at the first look; a dead holder whose host
    /// memory is still in `/dev/shm` is listed with [`Holder::left_in`] and stays counted).
    ///
    /// # Errors
    /// [`crate::Error::Timeout`] when a live process holds the lock for 2 s; [`ShmError::Shrunk`]
    /// when the ledger was cut short under this mapping; [`crate::Error::Os`] when `fstat` fails.
    pub fn snapshot(&self) -> Result<LedgerSnapshot> {
        let inner = &*self.inner;
        let (owner_uid, _, mode) = inner.seg.owner()?;
        let g = inner.lock()?;
        let dead = inner.reclaim_dead(&g, true);
        let held = inner.held();
        let budget = inner.budget();
        drop(g);
        let reclaimed = dead.iter().filter(|d| d.holder.left_in.is_none()).count() as u32;
        let holders: Vec<Holder> = held
            .into_iter()
            .map(
                |(i, identity, uid, bytes)| match dead.iter().find(|d| d.index == i) {
                    Some(d) => d.holder.clone(),
                    None => Holder {
                        liveness: identity.liveness_as(uid),
                        identity,
                        uid,
                        bytes,
                        left_in: None,
                    },
                },
            )
            .collect();
        Ok(LedgerSnapshot {
            name: inner.name().to_string(),
            device: inner.device,
            scope: inner.scope,
            owner_uid,
            mode,
            budget,
            used: holders.iter().fold(0u64, |a, h| a.saturating_add(h.bytes)),
            holders,
            reclaimed,
        })
    }
}

impl QuotaLedger {
    /// The reservations whose holder is dead (by its liveness lock, right across pid namespaces),
    /// freed when `free` (what every reserve and [`QuotaLedger::snapshot`] do anyway; for `gc`,
    /// and with `free = false` for its dry run, which changes nothing). A dead holder whose host
    /// memory is still in `/dev/shm` is returned with [`Holder::left_in`] set and is not freed:
    /// `gc` removes that segment first, then frees the entry.
    ///
    /// # Errors
    /// [`crate::Error::Timeout`] when a live process holds the lock for 2 s; [`ShmError::Shrunk`]
    /// when the ledger was cut short under this mapping.
    pub fn dead_holders(&self, free: bool) -> Result<Vec<Holder>> {
        let g = self.inner.lock()?;
        Ok(self
            .inner
            .reclaim_dead(&g, free)
            .into_iter()
            .map(|d| d.holder)
            .collect())
    }
}

impl Reservation {
    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The ledger it was taken from.
    pub fn ledger(&self) -> &QuotaLedger {
        &self.ledger
    }

    /// Records `segment` (a `/dev/shm` segment this process made) as where the reserved bytes
    /// live: should this process die, its entry stays (and its bytes counted) while that
    /// segment, by its inode and name, is still in `/dev/shm`, since host memory does not go with
    /// its process. For host memory; GPU memory is freed by the driver with its process and
    /// records nothing.
    ///
    /// # Errors
    /// [`crate::Error::Timeout`] when a live process holds the lock for 2 s; [`crate::Error::Os`]
    /// when the segment's `fstat` fails.
    pub fn record_memory(&self, segment: &Segment) -> Result<()> {
        if self.fork.inherited() {
            return Ok(());
        }
        let inode = segment.inode()?;
        let hash = name_hash(segment.name());
        let inner = &*self.ledger.inner;
        let _g = inner.lock()?;
        let e = inner.entry(self.index);
        // Relaxed: under the lock (every reader of these fields takes it). Only our own entry.
        if e.state.load(Ordering::Relaxed) == HELD && e.id.load(Ordering::Relaxed) == self.id {
            e.memory_inode.store(inode, Ordering::Relaxed);
            e.memory_name.store(hash, Ordering::Relaxed);
        }
        Ok(())
    }

    /// [`Reservation::record_memory`], logging a failure instead of returning it: the memory is
    /// made and the reservation held either way; without the record, a death of this process
    /// frees the entry at once, as for GPU memory.
    pub(crate) fn record_memory_or_warn(&self, segment: &Segment) {
        if let Err(e) = self.record_memory(segment) {
            tracing::warn!(
                "quota ledger {}: cannot record {} as where {} reserved bytes live ({e}); \
                 should this process die, they are freed before its segment is removed",
                self.ledger.name(),
                segment.name(),
                self.bytes
            );
        }
    }

    /// Returns the bytes to the ledger now (dropping does the same and logs a failure).
    ///
    /// # Errors
    /// [`crate::Error::Timeout`] when a live process holds the lock for 2 s (the entry stays held
    /// until this process exits, then it is reclaimed); [`ShmError::Shrunk`] when the ledger was
    /// cut short under this mapping (its entry is then not ours to free).
    pub fn release(mut self) -> Result<()> {
        self.released = true;
        self.free()
    }

    fn free(&self) -> Result<()> {
        if self.fork.inherited() {
            // A copy in a forked child: the entry is the parent's.
            return Ok(());
        }
        let inner = &*self.ledger.inner;
        let _g = inner.lock()?;
        let e = inner.entry(self.index);
        // Relaxed: under the lock. Only our own entry is freed (a repair may have freed it and a
        // later reserve taken it: then its id differs).
        if e.state.load(Ordering::Relaxed) == HELD && e.id.load(Ordering::Relaxed) == self.id {
            // SYNC POINT entry: Release, pairs with the Acquire loads of `state`.
            e.state.store(FREE, Ordering::Release);
            inner.store_used();
        }
        Ok(())
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if !self.released
            && let Err(e) = self.free()
        {
            // Safe to go on: the entry names this process, and is reclaimed once it exits.
            tracing::warn!(
                "quota ledger {}: returning {}: {e}; reclaimed when this process exits",
                self.ledger.name(),
                crate::error::bytes(self.bytes)
            );
        }
    }
}

/// That this process may change or remove the ledger in `seg`: its owner (the creator's uid) or
/// root.
///
/// # Errors
/// [`QuotaError::NotBudgetOwner`] otherwise; [`crate::Error::Os`] when `fstat` fails.
fn check_budget_owner(seg: &Segment) -> Result<()> {
    let (owner, _, _) = seg.owner()?;
    let ours = rustix::process::geteuid();
    if owner != ours.as_raw() && !ours.is_root() {
        return Err(QuotaError::NotBudgetOwner {
            name: seg.name().to_string(),
            owner,
            ours: ours.as_raw(),
        }
        .into());
    }
    Ok(())
}

/// Reserves `bytes` from the ledger of `scope` for `device` (all-zero UUID: host memory), for
/// memory that will live in the `/dev/shm` segment `segment` where it is host memory
/// ([`QuotaLedger::reserve_for`]); nothing when `scope` is `None` (no quota asked). For the
/// objects that opt in: channels' pools and tensor sets.
///
/// # Errors
/// [`QuotaError::NoBudget`] when no budget is set for that scope and device (no ledger); the
/// errors of [`QuotaLedger::open`] and [`QuotaLedger::reserve`].
pub(crate) fn reserve_in(
    scope: Option<QuotaScope>,
    device: Uuid,
    bytes: u64,
    segment: Option<&str>,
) -> Result<Option<Reservation>> {
    let Some(scope) = scope else {
        return Ok(None);
    };
    let ledger = match QuotaLedger::open(scope, device) {
        Ok(l) => l,
        Err(Error::Shm(ShmError::NotFound { .. })) => {
            return Err(QuotaError::NoBudget {
                name: scope.segment_name(device),
            }
            .into());
        }
        Err(e) => return Err(e),
    };
    ledger.reserve_for(bytes, segment).map(Some)
}

/// The names of the quota ledgers in `/dev/shm` (`cuda-ipc.quota.…`), sorted, whatever stands
/// under them: a FIFO, a directory or a symbolic link there blocks the ledger's creation, so it
/// is listed, and its opener says what it is ([`ShmError::NotASegment`]).
///
/// # Errors
/// [`crate::Error::Os`] when `/dev/shm` cannot be read.
pub fn list_ledgers() -> Result<Vec<String>> {
    let mut v: Vec<String> = crate::shm::list_names()?
        .into_iter()
        .map(|(n, ..)| n)
        .filter(|n| n.starts_with(LEDGER_PREFIX))
        .collect();
    v.sort();
    Ok(v)
}

/// Whether the segment `name` (a ledger's name, `cuda-ipc.quota.…`) is a ledger creation
/// abandoned half-way, by the rule [`QuotaLedger::set_budget`] replaces one by: this user's, and
/// empty or sparse for at least 2 s with no creator sizing it, or sized and never stamped for at
/// least 2 s with its header not begun or its recorded creator dead. Returns why, or `Ok(None)`:
/// nothing under the name, a ready ledger (its dead holders are
/// [`QuotaLedger::dead_holders`]'), a creation younger than 2 s, or a live creator's (or one whose
/// liveness cannot be told). Removing it is [`remove_abandoned`]'s. Changes nothing.
///
/// # Errors
/// [`crate::Error::InvalidArgument`] for a name that is not a ledger's; the typed errors that say
/// what else is under the name and why it is kept: [`ShmError::WrongOwner`] for another user's
/// segment (a group ledger of another member included), [`ShmError::InsecureMode`] for one open
/// to other users (any of the mode bits `0o007`), [`ShmError::NotASegment`] for a FIFO,
/// directory, socket or device, [`ShmError::TooSmall`] for a short file whose pages are there;
/// [`crate::Error::Os`] when a call fails.
///
/// # Examples
/// ```
/// use cuda_ipc::driver::Uuid;
/// use cuda_ipc::quota::{self, QuotaLedger, QuotaScope};
/// let mut dev = [0xd0u8; 16];
/// dev[12..].copy_from_slice(&std::process::id().to_le_bytes());
/// let ledger = QuotaLedger::set_budget(QuotaScope::user(), Uuid(dev), 1 << 20)?;
/// assert_eq!(quota::abandoned(ledger.name())?, None); // ready: not a leftover
/// ledger.remove()?;
/// # Ok::<(), cuda_ipc::Error>(())
/// ```
pub fn abandoned(name: &str) -> Result<Option<&'static str>> {
    Ok(judged(name)?.map(|(why, _)| why))
}

/// Removes the segment `name` (a ledger's name) when it is a ledger creation abandoned half-way
/// ([`abandoned`]), judged again right before, and only while the name still stands for the file
/// judged (`Segment::unlink_if_same`). Returns why it was removed; `Ok(None)` when nothing was
/// touched (nothing there, a ready ledger, a young creation, a live creator's, or a new file
/// under the name meanwhile). Another user's segment, a FIFO or a foreign file is never removed.
///
/// # Errors
/// As [`abandoned`]; [`crate::Error::Os`] when the unlink fails.
pub fn remove_abandoned(name: &str) -> Result<Option<&'static str>> {
    let Some((why, inode)) = judged(name)? else {
        return Ok(None);
    };
    Ok(Segment::unlink_if_same(name, inode)?.then_some(why))
}

/// [`judge_creation`] of a ledger's name, for [`abandoned`] and [`remove_abandoned`]: why and the
/// inode judged, when abandoned; `Ok(None)` when nothing is there or it is not abandoned.
fn judged(name: &str) -> Result<Option<(&'static str, u64)>> {
    if !name.starts_with(LEDGER_PREFIX) {
        return Err(Error::InvalidArgument(format!(
            "{name:?} is not a quota ledger's name (`{LEDGER_PREFIX}…`)"
        )));
    }
    match judge_creation(name) {
        Ok(Creation::Abandoned { why, inode, .. }) => Ok(Some((why, inode))),
        Ok(_) | Err(Error::Shm(ShmError::NotFound { .. })) => Ok(None),
        Err(e) => Err(e),
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::quota::layout::UNLIMITED;

    fn dev(tag: u8) -> Uuid {
        let mut d = [0u8; 16];
        d[0] = 0xfe;
        d[1] = tag;
        d[12..].copy_from_slice(&std::process::id().to_le_bytes());
        Uuid(d)
    }

    #[test]
    fn reservations_add_up_to_the_budget_and_come_back_when_dropped() {
        let d = dev(1);
        let l = QuotaLedger::set_budget(QuotaScope::user(), d, 100).unwrap();
        let a = l.reserve(60).unwrap();
        let b = l.reserve(40).unwrap();
        let e = l.reserve(1).unwrap_err();
        let msg = e.to_string();
        assert!(
            matches!(
                e,
                Error::Quota(QuotaError::OverQuota {
                    asked: 1,
                    budget: 100,
                    used: 100,
                    ..
                })
            ),
            "{msg}"
        );
        assert!(
            msg.contains(&format!("pid {}", std::process::id())),
            "{msg}"
        );
        assert!(
            msg.contains("holds 60 bytes") && msg.contains("holds 40 bytes"),
            "{msg}"
        );
        let s = l.snapshot().unwrap();
        assert_eq!((s.budget, s.used, s.holders.len()), (Some(100), 100, 2));
        assert_eq!(s.mode, 0o600);
        drop(a);
        assert_eq!(l.snapshot().unwrap().used, 40);
        let c = l.reserve(60).unwrap();
        b.release().unwrap();
        drop(c);
        assert_eq!(l.snapshot().unwrap().used, 0);
        // A lower budget judges only new reservations; UNLIMITED lifts it.
        QuotaLedger::set_budget(QuotaScope::user(), d, UNLIMITED).unwrap();
        let big = l.reserve(u64::MAX / 2).unwrap();
        assert_eq!(l.snapshot().unwrap().budget, None);
        drop(big);
        assert!(l.remove().unwrap());
    }

    #[test]
    fn a_half_written_entry_is_freed_by_the_next_locker() {
        let d = dev(2);
        let l = QuotaLedger::set_budget(QuotaScope::user(), d, 10).unwrap();
        // What a holder killed between WRITING and HELD leaves, with the lock released by the
        // kernel: an entry in WRITING.
        let e = l.inner.entry(3);
        e.bytes.store(10, Ordering::Relaxed);
        e.state.store(WRITING, Ordering::Release);
        // Garbage state words too.
        l.inner.entry(4).state.store(77, Ordering::Release);
        let r = l.reserve(10).unwrap();
        assert_eq!(l.inner.entry(4).state.load(Ordering::Relaxed), FREE);
        drop(r);
        assert!(l.remove().unwrap());
    }

    #[test]
    fn handles_and_reservations_go_between_threads() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<QuotaLedger>();
        send_sync::<Reservation>();
        // Threads of one process are kept apart by the handle's mutex (the OFD lock is shared by
        // their one open file): the sum never passes the budget.
        let d = dev(3);
        let l = QuotaLedger::set_budget(QuotaScope::user(), d, 10).unwrap();
        let got: Vec<Reservation> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..8).map(|_| s.spawn(|| l.reserve(3).ok())).collect();
            hs.into_iter().filter_map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(got.len(), 3);
        assert_eq!(l.snapshot().unwrap().used, 9);
        drop(got);
        assert!(l.remove().unwrap());
    }

    #[test]
    fn a_group_ledger_is_mode_0660_of_that_group_and_opens_by_its_name() {
        let egid = rustix::process::getegid().as_raw();
        let scope = QuotaScope::group(&egid.to_string()).unwrap();
        let d = dev(4);
        let l = QuotaLedger::set_budget(scope, d, 1 << 20).unwrap();
        let s = l.snapshot().unwrap();
        assert_eq!((s.mode, s.scope, s.budget), (0o660, scope, Some(1 << 20)));
        let (_, gid, _) = l.inner.seg.owner().unwrap();
        assert_eq!(gid, egid);
        let again = QuotaLedger::open_named(l.name()).unwrap();
        assert_eq!((again.scope(), again.device()), (scope, d));
        let r = again.reserve(1 << 20).unwrap();
        assert!(matches!(
            l.reserve(1),
            Err(Error::Quota(QuotaError::OverQuota { .. }))
        ));
        drop(r);
        // The user's ledger of the same device is another ledger.
        assert!(matches!(
            QuotaLedger::open(QuotaScope::user(), d),
            Err(Error::Shm(ShmError::NotFound { .. }))
        ));
        assert!(l.remove().unwrap());
    }

    #[test]
    fn names_and_scopes() {
        let d = Uuid([0xab; 16]);
        assert_eq!(
            QuotaScope::User(1000).segment_name(d),
            format!("cuda-ipc.quota.u1000.{}", "ab".repeat(16))
        );
        assert!(
            QuotaScope::Group(5)
                .segment_name(Uuid([0; 16]))
                .starts_with("cuda-ipc.quota.g5.")
        );
        assert!(matches!(
            QuotaScope::group("no-such-group-cuda-ipc-test"),
            Err(Error::Quota(QuotaError::BadGroup { .. }))
        ));
        let egid = rustix::process::getegid().as_raw();
        assert_eq!(
            QuotaScope::group(&egid.to_string()).unwrap(),
            QuotaScope::Group(egid)
        );
        assert!(
            QuotaScope::group("a\0b").is_err(),
            "a NUL byte is refused, not passed to libc"
        );
    }
}
