//! What dead processes left, found and removed by one rule set: for `cuda-ipc gc` and its dry run,
//! and for the Python extension's `cleanup`.
//!
//! Owns: the kinds of leftover ([`LeftoverKind`]) and of shared object ([`ObjectKind`]), one
//! [`Leftover`] type (what it is, whose, why it may go), a [`scan`] that lists them and a
//! [`remove`] that removes what a scan listed, each checked again right before it goes, and
//! reports exactly what went. The rules themselves are the layers' own, each judged and applied
//! where the state lives: the registry's recovery ([`Registry::reclaim_dead_listed`]) and its
//! abandoned creations ([`registry::remove_abandoned`]); the channel's dead producers, dead
//! consumers, abandoned creations and host pools ([`channel::reclaim`]); the tensor sets' dead
//! writers' parts, abandoned creations, dead readers and dead holders' slots
//! ([`tensorset::reclaim`]); the quota
//! ledgers' dead
//! holders ([`QuotaLedger::dead_holders`]); the liveness files ([`identity`]) and fd server
//! sockets ([`fdpass`]) of killed processes; the status files of killed lane bridges. This module
//! only lists and dispatches: it never reads a segment's bytes itself.
//!
//! What it never touches: anything of a live process or of one whose liveness cannot be told
//! (kept, with a note), another user's files (unless run as root, for per-process files), a
//! finished registry or a quota ledger itself (only what dead processes left inside them), and
//! anything under our names that is not ours (a FIFO, a foreign file: a problem, never removed).
//! Above every layer it cleans; nothing below imports it. Never calls CUDA.
//!
//! # Examples
//! ```
//! use cuda_ipc::cleanup::{self, Scope};
//! let scan = cleanup::scan(&Scope::everything())?;
//! for l in &scan.leftovers {
//!     println!("would remove {l}");
//! }
//! // cleanup::remove(&scan.leftovers) removes them, each checked again first.
//! # Ok::<(), cuda_ipc::Error>(())
//! ```

use crate::channel::{self, inspect as channel_inspect};
use crate::error::{Error, Result};
use crate::identity::{self, LivenessFile, ProcessIdentity};
use crate::ipc::fdpass::{self, StaleSocketFile};
use crate::quota::{self, QuotaLedger};
use crate::registry::{self, Reclaimed, Registry, RegistryOptions, inspect as registry_inspect};
use crate::shm::SHM_DIR;
use crate::tensorset::{self, inspect as tensorset_inspect, reclaim::Part};
use std::fmt;

mod holders;

/// A kind of object processes share through `/dev/shm`, each with its rooms: its module, its
/// inspection snapshot, its cleanup rule here, its rows in `cuda-ipc ls`, `watch` and `metrics`,
/// and its Python class (docs/ARCHITECTURE.md, "Object kinds").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ObjectKind {
    /// A named table of records ([`crate::registry`]).
    Registry,
    /// A producer/consumer channel: its control segment and, for host memory, its pool
    /// ([`crate::channel`]).
    Channel,
    /// A tensor set: its manifest, its generation channel and, for host memory, its data segment
    /// ([`crate::tensorset`]).
    TensorSet,
}

impl ObjectKind {
    /// Every kind, in the order [`scan`] visits them.
    pub const ALL: &'static [ObjectKind] = &[
        ObjectKind::Registry,
        ObjectKind::Channel,
        ObjectKind::TensorSet,
    ];

    /// Its name, as docs/ARCHITECTURE.md and `cuda-ipc gc` write it: `registry`, `channel`,
    /// `tensorset`.
    pub fn name(self) -> &'static str {
        match self {
            ObjectKind::Registry => "registry",
            ObjectKind::Channel => "channel",
            ObjectKind::TensorSet => "tensorset",
        }
    }

    /// The kinds of leftover a dead process can leave in an object of this kind.
    pub fn leftover_kinds(self) -> &'static [LeftoverKind] {
        match self {
            ObjectKind::Registry => &[
                LeftoverKind::RegistryRecord,
                LeftoverKind::RegistryLock,
                LeftoverKind::RegistryCorruptSlot,
                LeftoverKind::RegistryParticipant,
                LeftoverKind::RegistryCreation,
            ],
            ObjectKind::Channel => &[
                LeftoverKind::Channel,
                LeftoverKind::ChannelConsumer,
                LeftoverKind::ChannelCreation,
                LeftoverKind::HostPool,
            ],
            ObjectKind::TensorSet => &[
                LeftoverKind::TensorSet,
                LeftoverKind::TensorSetReader,
                LeftoverKind::TensorSetCreation,
                LeftoverKind::TensorSetHolder,
            ],
        }
    }
}

/// What a leftover is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LeftoverKind {
    /// A registry record published by a process that is dead.
    RegistryRecord,
    /// A registry slot's writer lock left by a dead writer (with its half-written record, if any).
    RegistryLock,
    /// A registry slot whose bytes are corrupt, or whose write was left open with no writer.
    RegistryCorruptSlot,
    /// A registry participant entry of a dead process.
    RegistryParticipant,
    /// A registry segment whose creation was abandoned half-way.
    RegistryCreation,
    /// A channel whose producer is dead: its control segment.
    Channel,
    /// A dead consumer's slot (and its holds) in a live producer's channel.
    ChannelConsumer,
    /// A channel control segment whose creation was abandoned half-way.
    ChannelCreation,
    /// A host channel's pool segment whose producer is dead (or whose creation was abandoned).
    HostPool,
    /// A part of a tensor set whose writer is dead (its manifest, generation channel or host data
    /// segment).
    TensorSet,
    /// A dead reader's slot (and its holds) in a live writer's tensor set.
    TensorSetReader,
    /// A part of a tensor set whose creation was abandoned half-way.
    TensorSetCreation,
    /// A dead process's slot in the holders segment of a tensor set that stays (its writer runs,
    /// or a live holder keeps it): a holder, a serving or writerless reader, or a dead writer.
    TensorSetHolder,
    /// A killed process's liveness file (`/dev/shm/cuda-ipc.live.*`).
    LivenessFile,
    /// A killed exporter's fd server socket file (`/dev/shm/cuda-ipc.fd.*`).
    FdSocket,
    /// A dead holder's reservation in a quota ledger.
    QuotaHolder,
    /// A killed lane bridge's status file (`/dev/shm/cuda-ipc.br.*`).
    BridgeStatus,
}

impl LeftoverKind {
    /// The kind of shared object it is part of; `None` for per-process files and quota holders.
    pub fn object_kind(self) -> Option<ObjectKind> {
        ObjectKind::ALL
            .iter()
            .copied()
            .find(|k| k.leftover_kinds().contains(&self))
    }
}

/// One thing a dead process left, as [`scan`] found it.
///
/// `Display` writes what `cuda-ipc gc` prints after `would remove` / `removed`, e.g. `channel X:
/// consumer slot 1 of dead pid 42 (start 1234)`.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Leftover {
    /// What it is.
    pub kind: LeftoverKind,
    /// The object it is in or is: a registry's segment name, a channel name, a quota ledger's
    /// segment name, or a per-process file's name in `/dev/shm`.
    pub object: String,
    /// The dead process it belonged to, where one is named.
    pub owner: Option<ProcessIdentity>,
    /// The owner uid of the file, where the rule reads one.
    pub uid: Option<u32>,
    /// Why it is a leftover, and what it holds, in words.
    pub what: String,
    /// What identifies it for [`remove`].
    target: Target,
}

impl fmt::Display for Leftover {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.what)
    }
}

/// What [`remove`] needs to find a leftover again.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Target {
    /// An item freed by the registry's own recovery.
    RegistryItem(RegistryKey),
    RegistrySegment,
    ChannelSegment,
    ChannelConsumer {
        index: u32,
    },
    ChannelCreation,
    HostPool,
    TensorSetPart(Part),
    TensorSetReader,
    TensorSetHolder {
        slot: usize,
    },
    Liveness(LivenessFile),
    Socket(StaleSocketFile),
    QuotaHolder {
        identity: ProcessIdentity,
        bytes: u64,
    },
    Bridge,
}

/// A registry item, as both the scan and the recovery name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RegistryKey {
    Record { slot: u32, seq: u64 },
    Lock { slot: u32 },
    Corrupt { slot: u32 },
    Participant { index: u32 },
}

/// Something [`scan`] or [`remove`] could not read or remove: it stays, and is a problem.
#[derive(Debug)]
#[non_exhaustive]
pub struct Problem {
    /// What it concerns, e.g. `registry NAME`, `channel NAME`, `quota ledger NAME`, `fd server
    /// sockets`.
    pub subject: String,
    /// What went wrong (an `Error::Shm(ShmError::WrongOwner { .. })` for another user's ledger,
    /// which a caller may take for a note rather than a problem).
    pub error: Error,
}

/// What [`scan`] found.
#[derive(Debug, Default)]
#[non_exhaustive]
pub struct Scan {
    /// The leftovers, in the order [`remove`] takes them.
    pub leftovers: Vec<Leftover>,
    /// What is kept because whether its process runs cannot be told, one line each (`channel X:
    /// ...`).
    pub kept: Vec<String>,
    /// What could not be read.
    pub problems: Vec<Problem>,
}

/// What [`remove`] did.
#[derive(Debug, Default)]
#[non_exhaustive]
pub struct Removal {
    /// What was removed, as the layers reported it: each a leftover of the scan, or one the same
    /// recovery freed beside them (a registry's or ledger's recovery frees every dead process's
    /// item it finds, checked under its own lock).
    pub removed: Vec<Leftover>,
    /// Leftovers of the scan that were not removed, with why (gone meanwhile, taken over by a new
    /// process, no longer stale).
    pub kept: Vec<(Leftover, &'static str)>,
    /// What could not be removed.
    pub problems: Vec<Problem>,
}

/// What [`scan`] looks at.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scope {
    /// Registry segment names; `None`: every registry in `/dev/shm`.
    registries: Option<Vec<String>>,
    /// Channel names; `None`: every channel in `/dev/shm`.
    channels: Option<Vec<String>>,
    /// Tensor set names; `None`: every tensor set in `/dev/shm`.
    tensor_sets: Option<Vec<String>>,
    /// Also the quota ledgers' dead holders and the per-process files.
    everything: bool,
}

impl Scope {
    /// Everything: every registry and channel in `/dev/shm`, the quota ledgers' dead holders, and
    /// the liveness files, fd server sockets and bridge status files of killed processes.
    pub fn everything() -> Scope {
        Scope {
            registries: None,
            channels: None,
            tensor_sets: None,
            everything: true,
        }
    }

    /// Only these registries (segment names) and channels (channel names), and the host pools of
    /// those channels.
    pub fn only(registries: Vec<String>, channels: Vec<String>) -> Scope {
        Scope {
            registries: Some(registries),
            channels: Some(channels),
            tensor_sets: Some(Vec::new()),
            everything: false,
        }
    }

    /// Also these tensor sets (names) in a scope made by [`Scope::only`].
    pub fn with_tensor_sets(mut self, names: Vec<String>) -> Scope {
        self.tensor_sets = Some(names);
        self
    }
}

fn leftover(
    kind: LeftoverKind,
    object: &str,
    owner: Option<ProcessIdentity>,
    uid: Option<u32>,
    what: String,
    target: Target,
) -> Leftover {
    Leftover {
        kind,
        object: object.to_string(),
        owner,
        uid,
        what,
        target,
    }
}

fn problem(subject: String, error: Error) -> Problem {
    Problem { subject, error }
}

/// Lists what dead processes left in `scope`, by the layers' own rules; changes nothing.
///
/// A registry or channel that cannot be read is a [`Problem`] (unless it is a creation abandoned
/// half-way: then it is that leftover); another user's quota ledger is a problem whose error is
/// `ShmError::WrongOwner`. Per-process files are this user's only, everyone's for root.
///
/// # Errors
/// [`Error::Os`] when `/dev/shm` cannot be listed (for the registries and channels of
/// [`Scope::everything`]).
pub fn scan(scope: &Scope) -> Result<Scan> {
    let mut s = Scan::default();
    let registries = match &scope.registries {
        Some(r) => r.clone(),
        None => registry_inspect::list_registries()?,
    };
    let channels = match &scope.channels {
        Some(c) => c.clone(),
        None => channel_inspect::list_channels()?,
    };
    for r in &registries {
        scan_registry(r, &mut s);
    }
    for c in &channels {
        scan_channel(c, &mut s);
    }
    scan_host_pools(scope.channels.as_deref(), &mut s);
    let sets = match &scope.tensor_sets {
        Some(t) => t.clone(),
        None => tensorset_inspect::list_tensor_sets()?,
    };
    for t in &sets {
        scan_tensor_set(t, &mut s);
    }
    if scope.everything {
        scan_quota(&mut s);
        scan_process_files(&mut s);
    }
    Ok(s)
}

fn scan_registry(r: &str, s: &mut Scan) {
    let snap = match registry_inspect::inspect(r) {
        Ok(snap) => snap,
        Err(e) => {
            // A creation abandoned half-way goes, by the rule `open_or_create` replaces it by;
            // anything else is a problem, and kept.
            match registry_inspect::abandoned(r) {
                Ok(Some(why)) => s.leftovers.push(leftover(
                    LeftoverKind::RegistryCreation,
                    r,
                    None,
                    None,
                    format!("registry {r}: segment {SHM_DIR}/{r}: {why}"),
                    Target::RegistrySegment,
                )),
                _ => s.problems.push(problem(format!("registry {r}"), e)),
            }
            return;
        }
    };
    let dead = identity::Liveness::Dead;
    for x in snap.records.iter().filter(|x| x.owner_liveness == dead) {
        let rec = &x.record;
        s.leftovers.push(leftover(
            LeftoverKind::RegistryRecord,
            r,
            Some(rec.owner),
            Some(rec.owner_uid),
            format!(
                "registry {r}: record {:?} (seq {}, slot {}) of dead {}",
                rec.name, rec.seq, rec.slot, rec.owner
            ),
            Target::RegistryItem(RegistryKey::Record {
                slot: rec.slot,
                seq: rec.seq,
            }),
        ));
    }
    for l in snap.locked_slots.iter().filter(|l| l.writer_dead) {
        s.leftovers.push(leftover(
            LeftoverKind::RegistryLock,
            r,
            l.writer,
            None,
            format!(
                "registry {r}: slot {} lock of dead pid {}{}",
                l.slot,
                l.writer_pid,
                if l.writing {
                    " and its half-written record"
                } else {
                    ""
                }
            ),
            Target::RegistryItem(RegistryKey::Lock { slot: l.slot }),
        ));
    }
    for (slot, why) in &snap.corrupt_slots {
        s.leftovers.push(leftover(
            LeftoverKind::RegistryCorruptSlot,
            r,
            None,
            None,
            format!("registry {r}: corrupt slot {slot} ({why})"),
            Target::RegistryItem(RegistryKey::Corrupt { slot: *slot }),
        ));
    }
    for p in snap.participants.iter().filter(|p| p.dead) {
        s.leftovers.push(leftover(
            LeftoverKind::RegistryParticipant,
            r,
            Some(p.identity),
            None,
            format!(
                "registry {r}: participant entry {} of dead {}",
                p.index, p.identity
            ),
            Target::RegistryItem(RegistryKey::Participant { index: p.index }),
        ));
    }
}

fn scan_channel(c: &str, s: &mut Scan) {
    let snap = match channel_inspect::inspect(c) {
        Ok(snap) => snap,
        Err(e) => {
            match channel_inspect::abandoned(c) {
                Ok(Some(why)) => s.leftovers.push(leftover(
                    LeftoverKind::ChannelCreation,
                    c,
                    None,
                    None,
                    format!(
                        "channel {c}: segment {SHM_DIR}/{}: {why}",
                        channel_inspect::segment_name(c)
                    ),
                    Target::ChannelCreation,
                )),
                _ => s.problems.push(problem(format!("channel {c}"), e)),
            }
            return;
        }
    };
    use identity::Liveness::{Dead, Unknown};
    if snap.producer_liveness == Unknown {
        s.kept.push(format!(
            "channel {c}: whether its producer ({}) runs cannot be told from here (its liveness \
             file cannot be read and its pid is not of this pid namespace)",
            snap.producer
        ));
    }
    for x in snap.consumers.iter().filter(|x| x.liveness == Unknown) {
        s.kept.push(format!(
            "channel {c}: consumer slot {} ({}): whether it runs cannot be told from here",
            x.index, x.identity
        ));
    }
    if snap.producer_liveness != Dead {
        // A live producer: only the slots (and holds) of dead consumers go.
        for x in snap.consumers.iter().filter(|x| x.liveness == Dead) {
            s.leftovers.push(consumer_leftover(c, x));
        }
        return;
    }
    let attached = if snap.consumers.is_empty() {
        "attached".to_string()
    } else {
        format!(
            "attached ({})",
            snap.consumers
                .iter()
                .map(|x| format!("{} {}", x.identity, liveness_word(x.liveness)))
                .collect::<Vec<_>>()
                .join(", ")
        )
    };
    s.leftovers.push(leftover(
        LeftoverKind::Channel,
        c,
        Some(snap.producer),
        None,
        format!(
            "channel {c}: segment {SHM_DIR}/{} ({} bytes) of dead producer {}, {} consumers {attached}",
            snap.segment,
            snap.segment_bytes,
            snap.producer,
            snap.consumers.len(),
        ),
        Target::ChannelSegment,
    ));
}

fn consumer_leftover(c: &str, x: &channel_inspect::ConsumerSnapshot) -> Leftover {
    leftover(
        LeftoverKind::ChannelConsumer,
        c,
        Some(x.identity),
        None,
        format!(
            "channel {c}: consumer slot {} of dead {}{}",
            x.index,
            x.identity,
            if x.holds.is_empty() {
                String::new()
            } else {
                format!(" and its holds on buffers {:?}", x.holds)
            }
        ),
        Target::ChannelConsumer {
            index: x.index as u32,
        },
    )
}

fn liveness_word(l: identity::Liveness) -> &'static str {
    match l {
        identity::Liveness::Alive => "alive",
        identity::Liveness::Dead => "dead",
        _ => "unknown",
    }
}

/// Host pools of dead producers (whether their channel segment is still there or not); with
/// `named`, only those of the channels named.
fn scan_host_pools(named: Option<&[String]>, s: &mut Scan) {
    let pools = match channel_inspect::stale_host_pools() {
        Ok(p) => p,
        Err(e) => {
            s.problems.push(problem("host pools".into(), e));
            return;
        }
    };
    for (c, why) in pools {
        if named.is_some_and(|n| !n.contains(&c)) {
            continue;
        }
        s.leftovers.push(leftover(
            LeftoverKind::HostPool,
            &c,
            None,
            Some(rustix::process::geteuid().as_raw()),
            format!(
                "host pool {SHM_DIR}/{} of channel {c}: {why}",
                channel_inspect::pool_segment_name(&c)
            ),
            Target::HostPool,
        ));
    }
}

/// A tensor set's parts left by a dead writer or an abandoned creation, and dead readers of a
/// live writer's set.
fn scan_tensor_set(t: &str, s: &mut Scan) {
    let parts = match tensorset::reclaim::stale_parts(t) {
        Ok(p) => p,
        Err(e) => {
            s.problems.push(problem(format!("tensorset {t}"), e));
            return;
        }
    };
    let writer_dead = parts
        .iter()
        .any(|p| p.part == Part::Manifest && p.writer.is_some());
    for p in &parts {
        let (kind, whose) = match p.writer {
            Some(w) => (LeftoverKind::TensorSet, format!(" of dead writer {w}")),
            None => (LeftoverKind::TensorSetCreation, String::new()),
        };
        s.leftovers.push(leftover(
            kind,
            t,
            p.writer,
            Some(rustix::process::geteuid().as_raw()),
            format!(
                "tensorset {t}: {} {SHM_DIR}/{} ({} bytes){whose}: {}",
                p.part.word(),
                p.segment,
                p.bytes,
                p.why
            ),
            Target::TensorSetPart(p.part),
        ));
    }
    if !parts.iter().any(|p| p.part == Part::Holders) {
        holders::scan(t, s);
    }
    if writer_dead {
        return;
    }
    // A live writer (or none readable): only dead readers' slots go.
    if let Ok(snap) = tensorset_inspect::inspect(t) {
        for r in snap
            .readers
            .iter()
            .filter(|r| r.liveness == identity::Liveness::Dead)
        {
            s.leftovers.push(leftover(
                LeftoverKind::TensorSetReader,
                t,
                Some(r.identity),
                None,
                format!(
                    "tensorset {t}: reader slot {} of dead pid {} ({}), holding generations {:?}",
                    r.slot, r.identity.pid, r.identity, r.held
                ),
                Target::TensorSetReader,
            ));
        }
    }
}

fn scan_quota(s: &mut Scan) {
    let names = match quota::list_ledgers() {
        Ok(n) => n,
        Err(e) => {
            s.problems.push(problem("quota ledgers".into(), e));
            return;
        }
    };
    for name in names {
        match QuotaLedger::open_named(&name).and_then(|l| l.dead_holders(false)) {
            Ok(dead) => s
                .leftovers
                .extend(dead.iter().map(|h| holder_leftover(&name, h))),
            Err(e) => s.problems.push(problem(format!("quota ledger {name}"), e)),
        }
    }
}

fn holder_leftover(ledger: &str, h: &quota::Holder) -> Leftover {
    leftover(
        LeftoverKind::QuotaHolder,
        ledger,
        Some(h.identity),
        Some(h.uid),
        format!(
            "quota ledger {ledger}: reservation of {} bytes of dead {}",
            h.bytes, h.identity
        ),
        Target::QuotaHolder {
            identity: h.identity,
            bytes: h.bytes,
        },
    )
}

/// Whether a file of `uid` is ours to remove: this user's, or anyone's for root.
fn ours(uid: u32) -> bool {
    let me = rustix::process::geteuid();
    me.is_root() || me.as_raw() == uid
}

fn scan_process_files(s: &mut Scan) {
    // Sockets first: their staleness is read through the liveness files.
    match fdpass::stale_socket_files() {
        Ok(files) => s
            .leftovers
            .extend(files.into_iter().filter(|f| ours(f.uid)).map(|f| {
                leftover(
                    LeftoverKind::FdSocket,
                    &f.name.clone(),
                    Some(f.identity),
                    Some(f.uid),
                    format!(
                        "fd server socket {SHM_DIR}/{} of dead {}",
                        f.name, f.identity
                    ),
                    Target::Socket(f),
                )
            })),
        Err(e) => s.problems.push(problem("fd server sockets".into(), e)),
    }
    match identity::stale_liveness_files() {
        Ok(files) => s
            .leftovers
            .extend(files.into_iter().filter(|f| ours(f.uid)).map(|f| {
                leftover(
                    LeftoverKind::LivenessFile,
                    &f.name.clone(),
                    Some(f.identity),
                    Some(f.uid),
                    format!("liveness file {SHM_DIR}/{} of dead {}", f.name, f.identity),
                    Target::Liveness(f),
                )
            })),
        Err(e) => s.problems.push(problem("liveness files".into(), e)),
    }
    for (c, uid) in stale_bridge_status_files() {
        if ours(uid) {
            s.leftovers.push(leftover(
                LeftoverKind::BridgeStatus,
                &c,
                None,
                Some(uid),
                format!("bridge status {SHM_DIR}/{BRIDGE_PREFIX}{c} of a dead bridge"),
                Target::Bridge,
            ));
        }
    }
}

/// The prefix of a lane bridge's status file: channel `NAME`'s is `/dev/shm/cuda-ipc.br.NAME`
/// (written by `remote`; a bridge removes its own at the end of a session).
pub const BRIDGE_PREFIX: &str = "cuda-ipc.br.";

/// Whether the bridge whose status file names channel `c` is dead: the file is there and parses,
/// and its `pid` no longer runs with its `start_time` (the rule `cuda-ipc ls` shows it by).
/// `None` when there is no such file or it does not parse (kept).
fn bridge_dead(c: &str) -> Option<bool> {
    let text = std::fs::read_to_string(format!("{SHM_DIR}/{BRIDGE_PREFIX}{c}")).ok()?;
    let (mut pid, mut start, mut role) = (None, None, false);
    for line in text.lines() {
        match line.split_once('=') {
            Some(("pid", v)) => pid = v.parse::<u32>().ok(),
            Some(("start_time", v)) => start = v.parse::<u64>().ok(),
            Some(("role", v)) => role = !v.is_empty(),
            _ => {}
        }
    }
    let pid = pid.filter(|&p| p != 0 && role)?;
    let now = identity::start_time_of(pid).ok().flatten();
    Some(now != Some(start.unwrap_or(0)))
}

/// Status files of dead bridges, as (channel, owner uid). A bridge's temporary file
/// (`NAME.tmp-lane-PID`) is not a status file.
fn stale_bridge_status_files() -> Vec<(String, u32)> {
    use std::os::unix::fs::MetadataExt as _;
    let Ok(dir) = std::fs::read_dir(SHM_DIR) else {
        return Vec::new();
    };
    let mut v: Vec<(String, u32)> = dir
        .filter_map(|e| {
            let e = e.ok()?;
            let name = e.file_name().into_string().ok()?;
            let c = name.strip_prefix(BRIDGE_PREFIX)?.to_string();
            let m = e.metadata().ok()?;
            if c.contains(".tmp-lane-") || !m.is_file() {
                return None;
            }
            bridge_dead(&c)?.then_some((c, m.uid()))
        })
        .collect();
    v.sort();
    v
}

/// Removes what a [`scan`] listed, each checked again right before it goes by the same rule (a
/// registry's and a ledger's items by their own recovery under their own locks; a channel, pool
/// or segment only while its name still stands for what was judged), and reports what went.
///
/// Leftovers are taken in the order given, grouped per registry and per ledger (whose recovery
/// frees every dead item at once: what it freed beside the ones listed is reported too). A channel
/// whose producer died goes before its host pool.
pub fn remove(leftovers: &[Leftover]) -> Removal {
    let mut out = Removal::default();
    let mut done_registries: Vec<&str> = Vec::new();
    let mut done_ledgers: Vec<&str> = Vec::new();
    let mut done_held: Vec<&str> = Vec::new();
    for l in leftovers {
        match &l.target {
            Target::RegistryItem(_) => {
                if !done_registries.contains(&l.object.as_str()) {
                    done_registries.push(&l.object);
                    reclaim_registry(&l.object, leftovers, &mut out);
                }
            }
            Target::QuotaHolder { .. } => {
                if !done_ledgers.contains(&l.object.as_str()) {
                    done_ledgers.push(&l.object);
                    reclaim_ledger(&l.object, leftovers, &mut out);
                }
            }
            Target::RegistrySegment => {
                one(
                    l,
                    registry::remove_abandoned(&l.object).map(|r| r.is_some()),
                    &mut out,
                );
            }
            Target::ChannelCreation => one(
                l,
                channel::reclaim::remove_abandoned(&l.object).map(|r| r.is_some()),
                &mut out,
            ),
            Target::ChannelSegment => match channel::reclaim::remove_stale_control(&l.object) {
                Ok(Some(_)) => out.removed.push(l.clone()),
                Ok(None) => out
                    .kept
                    .push((l.clone(), "a new producer took it over meanwhile")),
                Err(e) => out
                    .problems
                    .push(problem(format!("channel {}", l.object), e)),
            },
            Target::ChannelConsumer { index } => {
                match channel::reclaim::release_dead_consumers(&l.object) {
                    Ok(freed) => {
                        for x in &freed {
                            let f = consumer_leftover(&l.object, x);
                            if !out.removed.contains(&f) {
                                out.removed.push(f);
                            }
                        }
                        if !freed.iter().any(|x| x.index as u32 == *index)
                            && !out.removed.contains(l)
                        {
                            out.kept.push((l.clone(), "gone or no longer dead"));
                        }
                    }
                    Err(e) => out
                        .problems
                        .push(problem(format!("channel {}", l.object), e)),
                }
            }
            Target::HostPool => one(
                l,
                channel::reclaim::remove_stale_host_pool(&l.object).map(|r| r.is_some()),
                &mut out,
            ),
            Target::TensorSetPart(p) => one(
                l,
                tensorset::reclaim::remove_part(&l.object, *p).map(|r| r.is_some()),
                &mut out,
            ),
            Target::TensorSetReader => one(
                l,
                tensorset::reclaim::release_dead_readers(&l.object).map(|_| {
                    // Freed when its slot is no longer the dead reader's.
                    tensorset_inspect::inspect(&l.object).map_or(true, |snap| {
                        !snap.readers.iter().any(|r| Some(r.identity) == l.owner)
                    })
                }),
                &mut out,
            ),
            Target::TensorSetHolder { .. } => {
                if !done_held.contains(&l.object.as_str()) {
                    done_held.push(&l.object);
                    holders::free(&l.object, leftovers, &mut out);
                }
            }
            Target::Socket(f) => one(l, fdpass::remove_stale_socket_file(f), &mut out),
            Target::Liveness(f) => one(l, identity::remove_stale_liveness_file(f), &mut out),
            Target::Bridge => {
                let r = if bridge_dead(&l.object) == Some(true) {
                    let path = format!("{SHM_DIR}/{BRIDGE_PREFIX}{}", l.object);
                    match std::fs::remove_file(&path) {
                        Ok(()) => Ok(true),
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
                        Err(e) => Err(crate::error::OsError::io("unlink", path, e).into()),
                    }
                } else {
                    Ok(false)
                };
                one(l, r, &mut out);
            }
        }
    }
    out
}

/// Records the outcome of removing one leftover.
fn one(l: &Leftover, r: Result<bool>, out: &mut Removal) {
    match r {
        Ok(true) => out.removed.push(l.clone()),
        Ok(false) => out.kept.push((l.clone(), "gone or no longer stale")),
        Err(e) => out.problems.push(problem(l.what.clone(), e)),
    }
}

/// Runs registry `r`'s own recovery (joining it: one participant entry, freed again on drop) and
/// reports each item it freed, as the scan described it where the scan listed it.
fn reclaim_registry(r: &str, listed: &[Leftover], out: &mut Removal) {
    // With group access, as `inspect` reads it: a registry shared with our group is reclaimed
    // as it is listed.
    let freed = Registry::open(r, &RegistryOptions::new().group_access(true)).and_then(|reg| {
        let (_, mut freed) = reg.reclaim_dead_listed()?;
        freed.splice(0..0, reg.reclaimed_on_open().iter().cloned());
        Ok(freed)
    });
    let freed = match freed {
        Ok(f) => f,
        Err(e) => {
            out.problems.push(problem(format!("registry {r}"), e));
            return;
        }
    };
    let mut seen = Vec::new();
    for f in &freed {
        let key = match f {
            Reclaimed::Record { slot, seq, .. } => RegistryKey::Record {
                slot: *slot,
                seq: *seq,
            },
            Reclaimed::Lock { slot, .. } => RegistryKey::Lock { slot: *slot },
            Reclaimed::CorruptSlot { slot } => RegistryKey::Corrupt { slot: *slot },
            Reclaimed::Participant { index, .. } => RegistryKey::Participant { index: *index },
        };
        seen.push(key);
        let scanned = listed
            .iter()
            .find(|l| l.object == r && l.target == Target::RegistryItem(key));
        out.removed.push(match scanned {
            Some(l) => l.clone(),
            None => reclaimed_leftover(r, f, key),
        });
    }
    for l in listed.iter().filter(|l| l.object == r) {
        if let Target::RegistryItem(k) = l.target
            && !seen.contains(&k)
        {
            out.kept.push((l.clone(), "gone or no longer dead"));
        }
    }
}

/// A leftover for an item the registry's recovery freed that the scan had not listed (it died
/// meanwhile).
fn reclaimed_leftover(r: &str, f: &Reclaimed, key: RegistryKey) -> Leftover {
    let (kind, owner, what) = match f {
        Reclaimed::Record {
            slot,
            seq,
            name,
            owner,
        } => (
            LeftoverKind::RegistryRecord,
            Some(*owner),
            format!("record {name:?} (seq {seq}, slot {slot}) of dead {owner}"),
        ),
        Reclaimed::Lock {
            slot,
            writer_pid,
            dropped_record,
        } => (
            LeftoverKind::RegistryLock,
            None,
            format!(
                "slot {slot} lock of dead pid {writer_pid}{}",
                if *dropped_record {
                    " and its half-written record"
                } else {
                    ""
                }
            ),
        ),
        Reclaimed::Participant { index, pid } => (
            LeftoverKind::RegistryParticipant,
            None,
            format!("participant entry {index} of dead pid {pid}"),
        ),
        Reclaimed::CorruptSlot { slot } => (
            LeftoverKind::RegistryCorruptSlot,
            None,
            format!("corrupt slot {slot}"),
        ),
    };
    leftover(
        kind,
        r,
        owner,
        None,
        format!("registry {r}: {what}"),
        Target::RegistryItem(key),
    )
}

/// Frees the dead holders' reservations of ledger `name` (under its lock, by the rule every
/// reserve applies) and reports each.
fn reclaim_ledger(name: &str, listed: &[Leftover], out: &mut Removal) {
    match QuotaLedger::open_named(name).and_then(|l| l.dead_holders(true)) {
        Ok(freed) => {
            let freed: Vec<Leftover> = freed.iter().map(|h| holder_leftover(name, h)).collect();
            for l in listed.iter().filter(|l| l.object == name) {
                if matches!(l.target, Target::QuotaHolder { .. }) && !freed.contains(l) {
                    out.kept.push((l.clone(), "gone or no longer dead"));
                }
            }
            out.removed.extend(freed);
        }
        Err(e) => out
            .problems
            .push(problem(format!("quota ledger {name}"), e)),
    }
}
