//! The serving side: [`Holder`] (a process that keeps a set's fds and serves them, with no CUDA
//! context), the serving part a reader with [`crate::tensorset::ReaderOptions::serve`] keeps
//! ([`Serving`]), the fetch of every fd of a set from its writer or a live holder
//! ([`fetch_all`]), and a reader's import that falls back to holders ([`FdSource`]).

use super::{HolderRole, HoldersSegment, SlotClaim, check_entries};
use crate::error::{Error, Result};
use crate::identity::{Liveness, ProcessIdentity};
use crate::ipc::fdpass::{self, FdExport, FdPassError, FdTransport};
use crate::shm::{Segment, ShmError};
use crate::tensorset::error::TensorSetError;
use crate::tensorset::manifest::{KIND_HOST, KIND_LEGACY, KIND_POOL, KIND_VMM, Manifest};
use crate::tensorset::segment::{self, INIT_WAIT};
use crate::token::Token;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long one server may take to hand over a set's fds.
const FETCH_TIMEOUT: Duration = Duration::from_secs(5);

/// Why set `set` (manifest `m`) cannot be held, if it cannot.
fn holdable(set: &str, m: &Manifest) -> Result<()> {
    let why = match m.kind {
        KIND_VMM => {
            check_entries(set, m.buffers, m.layout.allocations().len())?;
            if m.holders_generation != 0 {
                return Ok(());
            }
            "its writer made no holders segment (a build before holders)"
        }
        KIND_HOST => {
            "a host set's readers map its shared memory directly, with no file descriptor to \
             hold; once its writer is gone a new reader is refused (WriterGone) and `gc` removes \
             the set"
        }
        KIND_POOL => "pool memory imported elsewhere is undefined once its exporter frees it",
        KIND_LEGACY => "legacy IPC memory has no file descriptor to forward",
        _ => "an unknown memory kind",
    };
    Err(TensorSetError::NotHoldable {
        name: set.to_string(),
        why: why.to_string(),
    }
    .into())
}

/// Opens the holders segment that `m` names.
fn open_holders(set: &str, m: &Manifest) -> Result<HoldersSegment> {
    holdable(set, m)?;
    HoldersSegment::open(
        set,
        Some((
            m.holders_generation,
            m.buffers,
            m.layout.allocations().len(),
        )),
    )
}

/// The fds of every allocation of set `set` (manifest `m`, holders segment `holders`), index
/// b × A + a: from the writer while it runs (`crate::ipc::fetch_from_exporters`: one round trip,
/// this process's fd transport), else from each live server of the holders segment in turn (its
/// identity checked by the fetch, its ids from its slot). Returns the fds and the process that handed them over.
///
/// # Errors
/// [`TensorSetError::NoServer`] naming every server tried and what it said; token errors.
pub(crate) fn fetch_all(
    set: &str,
    m: &Manifest,
    holders: &HoldersSegment,
) -> Result<(Vec<OwnedFd>, ProcessIdentity)> {
    let toks = m
        .tokens
        .iter()
        .flatten()
        .map(|t| Token::from_bytes(t))
        .collect::<Result<Vec<_>>>()?;
    let mut tried = Vec::new();
    if let Some(first) = toks.first()
        && toks.iter().all(|t| t.exporter == first.exporter)
    {
        let refs: Vec<&Token> = toks.iter().collect();
        match crate::ipc::fetch_from_exporters(&refs, Some(set_uid())) {
            Ok(fds) => return Ok((fds, first.exporter)),
            Err(e) => tried.push(format!("the writer ({}): {e}", first.exporter)),
        }
    }
    for s in holders.servers() {
        // The writer's slot names the tokens' own exports, tried above.
        if s.role == HolderRole::Writer || !s.role.serves() || s.ids.len() != toks.len() {
            continue;
        }
        if s.identity.liveness_as(s.uid) == Liveness::Dead {
            tried.push(format!("{} {} (dead)", s.role.word(), s.identity));
            continue;
        }
        let ids: Vec<(u32, i32)> = s.ids.iter().map(|&i| (i, -1)).collect();
        match fdpass::fetch_many_from_uid(
            &s.identity,
            s.uid,
            &ids,
            FdTransport::Socket,
            FETCH_TIMEOUT,
        ) {
            Ok(fds) => return Ok((fds, s.identity)),
            Err(e) => tried.push(format!("{} {}: {e}", s.role.word(), s.identity)),
        }
    }
    if tried.len() < 2 {
        tried.push("no live holder serves it".into());
    }
    Err(TensorSetError::NoServer {
        name: set.to_string(),
        tried: tried.join("; "),
    }
    .into())
}

/// The uid a set's writer runs as: this process's, since a set's manifest is opened only when
/// it belongs to this process's uid (its writer made it). Its fd socket and liveness are checked
/// against it, also across pid namespaces and by root ([`fdpass::fetch_many_from_uid`]).
fn set_uid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// Where a reader's imports get their fds: the token's exporter, and once that is gone, the set's
/// holders (fetched once, all fds in one round trip, on the first import that needs them).
pub(crate) struct FdSource<'a> {
    set: &'a str,
    m: &'a Manifest,
    fds: Option<Vec<OwnedFd>>,
}

impl<'a> FdSource<'a> {
    /// The source for set `set` with manifest `m`.
    pub(crate) fn new(set: &'a str, m: &'a Manifest) -> FdSource<'a> {
        FdSource { set, m, fds: None }
    }

    /// The fds of `asked` (tokens of this set's allocation table, those the import cache lacks),
    /// in order: from their exporter (the writer, one round trip:
    /// [`crate::ipc::fetch_from_exporters`]), and when it is gone
    /// ([`FdPassError::PeerGone`]) and the set has a holders segment, from a live holder (every
    /// allocation's fd fetched once, the asked ones duplicated out of them). The fd source of
    /// [`ImportedBuffer::open_many`](crate::ipc::ImportedBuffer::open_many). `waiting` runs once while the writer prepares its answer
    /// ([`crate::ipc::fetch_from_exporters_then`]; not where the fds come from elsewhere).
    ///
    /// # Errors
    /// The exporter's fetch errors; [`TensorSetError::NoServer`] naming the writer and every holder
    /// tried when nobody hands the fds over; [`Error::InvalidArgument`] for a token that is not
    /// one of the set's.
    pub(crate) fn fetch(
        &mut self,
        asked: &[&Token],
        waiting: &mut dyn FnMut(),
    ) -> Result<Vec<OwnedFd>> {
        match crate::ipc::fetch_from_exporters_then(asked, Some(set_uid()), waiting) {
            Err(Error::FdPass(FdPassError::PeerGone { .. }))
                if self.m.kind == KIND_VMM && self.m.holders_generation != 0 =>
            {
                if self.fds.is_none() {
                    let holders = open_holders(self.set, self.m)?;
                    self.fds = Some(fetch_all(self.set, self.m, &holders)?.0);
                }
                let all = self.fds.as_deref().unwrap_or_default();
                asked
                    .iter()
                    .map(|t| {
                        let at = self
                            .m
                            .tokens
                            .iter()
                            .flatten()
                            .position(|b| Token::from_bytes(b).is_ok_and(|x| x == **t))
                            .ok_or_else(|| {
                                Error::InvalidArgument(format!(
                                    "export {} is not in set {}'s allocation table",
                                    t.export_id, self.set
                                ))
                            })?;
                        let fd = all.get(at).ok_or_else(|| {
                            Error::InvalidArgument(format!("allocation {at} of the set's table"))
                        })?;
                        fd.try_clone().map_err(|e| {
                            Error::Os(crate::error::OsError::io(
                                "fcntl(F_DUPFD_CLOEXEC)",
                                format!("allocation {at}"),
                                e,
                            ))
                        })
                    })
                    .collect()
            }
            r => r,
        }
    }
}

/// What a serving process keeps: its slot, its exports of the set's fds, the holders segment.
/// Drop lets go of the slot first (no new reader is sent here), then withdraws the exports
/// (closing this process's copies of the fds).
pub(crate) struct Serving {
    // Drop order: the slot (released in Drop), then the exports, then the segment's mapping.
    claim: Option<SlotClaim>,
    exports: Vec<FdExport>,
    holders: HoldersSegment,
    source: ProcessIdentity,
}

impl std::fmt::Debug for Serving {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Serving")
            .field("holders", &self.holders)
            .field("exports", &self.exports.len())
            .finish_non_exhaustive()
    }
}

impl Serving {
    /// Fetches every fd of set `set` (manifest `m`), offers them from this process and claims a
    /// slot in `role`.
    ///
    /// # Errors
    /// [`TensorSetError::NotHoldable`]; as the holders segment's open; as [`fetch_all`];
    /// [`TensorSetError::NoHolderSlot`]; [`Error::Os`] when the fd server cannot start.
    pub(crate) fn start(set: &str, m: &Manifest, role: HolderRole) -> Result<Serving> {
        let holders = open_holders(set, m)?;
        let (fds, source) = fetch_all(set, m, &holders)?;
        let exports = fds
            .into_iter()
            .map(FdExport::new)
            .collect::<Result<Vec<_>>>()?;
        let ids: Vec<u32> = exports.iter().map(FdExport::id).collect();
        let claim = holders.claim(role, &ids)?;
        Ok(Serving {
            claim: Some(claim),
            exports,
            holders,
            source,
        })
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        if let Some(c) = self.claim.take() {
            self.holders.release(c);
        }
    }
}

/// Whether a held set still stands: see [`Holder::status`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum HolderStatus {
    /// The set's names stand for what this holder serves (its writer may be dead: the holder
    /// keeps it attachable).
    Serving,
    /// Its writer closed it (its names are gone).
    Closed,
    /// Another set was made under its name.
    Replaced,
    /// Its holders segment was cut short under this holder's mapping (another process of this
    /// user truncated it): no slot of it is touched any more; drop the holder.
    Damaged,
}

impl HolderStatus {
    /// In words: `serving`, `closed by its writer`, `replaced by a new set`, `its holders segment
    /// was cut short`.
    pub fn word(self) -> &'static str {
        match self {
            HolderStatus::Serving => "serving",
            HolderStatus::Closed => "closed by its writer",
            HolderStatus::Replaced => "replaced by a new set",
            HolderStatus::Damaged => "its holders segment was cut short",
        }
    }
}

/// Keeps a VMM tensor set attachable after its writer dies: holds an fd of every allocation of
/// every buffer (fetched from the writer, or from another live holder), serves them from this
/// process's fd server (the same peer checks as the writer's: this user or root) and records
/// itself in the set's holders segment, where new readers find it. Needs no CUDA context (fds are
/// opaque here) and maps nothing, but each fd pins the set's device memory (B × bytes per buffer,
/// [`Holder::bytes`]) until the holder drops.
///
/// Dropping it lets go of its slot and closes its fds; the memory goes back to the device once no
/// process maps it or holds an fd of it. It does not notice by itself that the set was closed or
/// replaced: ask [`Holder::status`] (or [`Holder::wait`]) and drop it then.
///
/// # Examples
/// ```no_run
/// use cuda_ipc::tensorset::{Holder, HolderStatus};
/// use std::time::Duration;
/// let h = Holder::open("weights")?;
/// println!("holding {} allocations, {} bytes", h.allocations(), h.bytes());
/// let why = h.wait(None); // until the writer closes the set or a new one replaces it
/// assert_ne!(why, HolderStatus::Serving);
/// # Ok::<(), cuda_ipc::Error>(())
/// ```
pub struct Holder {
    // Drop order: the serving part (slot, exports), then the manifest's mapping.
    serving: Serving,
    manifest: Arc<Segment>,
    name: String,
    allocations: usize,
    bytes: u64,
}

impl std::fmt::Debug for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Holder")
            .field("name", &self.name)
            .field("allocations", &self.allocations)
            .field("bytes", &self.bytes)
            .finish_non_exhaustive()
    }
}

impl Holder {
    /// Holds tensor set `name`: opens its manifest and holders segment, fetches every allocation's
    /// fd (from the writer while it runs, else from a live holder: the fetch checks that the
    /// process answering is the one named), offers them from this process and claims a slot.
    ///
    /// # Errors
    /// [`TensorSetError::NotFound`] and the manifest's other errors (as
    /// [`crate::tensorset::TensorSetReader::open`]); [`TensorSetError::NotHoldable`] for a host,
    /// pool or legacy set, one without a holders segment, or more than
    /// [`super::MAX_HOLDER_ENTRIES`] allocations; [`TensorSetError::BadManifest`] naming the
    /// holders segment when it is not the one the manifest names; [`TensorSetError::NoServer`]
    /// when neither the writer nor a holder hands the fds over; [`TensorSetError::NoHolderSlot`]
    /// when every slot serves a live process; [`Error::Os`] when this process's fd server cannot
    /// start.
    pub fn open(name: &str) -> Result<Holder> {
        let opened = segment::open_manifest(name, INIT_WAIT)?;
        let m = &opened.manifest;
        let serving = Serving::start(name, m, HolderRole::Holder)?;
        Ok(Holder {
            allocations: serving.exports.len(),
            bytes: m.layout.bytes_per_buffer().saturating_mul(m.buffers as u64),
            serving,
            manifest: opened.seg,
            name: name.to_string(),
        })
    }

    /// The set's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// File descriptors held: B × A.
    pub fn allocations(&self) -> usize {
        self.allocations
    }

    /// Device bytes this holder pins: B × bytes per buffer (the allocations' lengths as the
    /// manifest records them; the driver rounds each up to its granularity).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The process the fds were fetched from (the writer, or another holder).
    pub fn source(&self) -> ProcessIdentity {
        self.serving.source
    }

    /// Whether the set's names still stand for what this holder serves: [`HolderStatus::Closed`]
    /// once its writer closed it (the manifest or the holders segment removed),
    /// [`HolderStatus::Replaced`] once another set was made under its name (a writer that resumed
    /// on the memory, over the same holders segment, keeps it [`HolderStatus::Serving`]),
    /// [`HolderStatus::Damaged`] once its holders segment was cut short under its mapping. Two
    /// `stat` calls and an `fstat`.
    pub fn status(&self) -> HolderStatus {
        if self.serving.holders.segment().check_intact().is_err() {
            return HolderStatus::Damaged;
        }
        for (k, seg) in [self.serving.holders.segment(), &self.manifest]
            .into_iter()
            .enumerate()
        {
            match Segment::stat(seg.name()) {
                Err(Error::Shm(ShmError::NotFound { .. })) => return HolderStatus::Closed,
                Ok(i) if seg.inode().is_ok_and(|mine| mine != i.inode) => {
                    // A new manifest over the same holders segment: a writer resumed on the
                    // memory this holder keeps.
                    let resumed = k == 1
                        && segment::open_manifest_unverified(&self.name, Duration::ZERO).is_ok_and(
                            |o| o.manifest.holders_generation == self.serving.holders.generation(),
                        );
                    if !resumed {
                        return HolderStatus::Replaced;
                    }
                }
                _ => {}
            }
        }
        HolderStatus::Serving
    }

    /// `status() == Serving`.
    pub fn is_current(&self) -> bool {
        self.status() == HolderStatus::Serving
    }

    /// Waits (looking every 100 ms) until [`Holder::status`] is no longer
    /// [`HolderStatus::Serving`], at most `timeout` (`None`: no bound); returns the status last
    /// seen.
    pub fn wait(&self, timeout: Option<Duration>) -> HolderStatus {
        let start = Instant::now();
        loop {
            let s = self.status();
            if s != HolderStatus::Serving || timeout.is_some_and(|t| start.elapsed() >= t) {
                return s;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}
