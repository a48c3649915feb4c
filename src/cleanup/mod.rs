//! What dead processes left, found and removed by one rule set: for `cuda-ipc gc` and its dry run,
//! and for the Python extension's `cleanup`.
//!
//! Owns: the kinds of leftover ([`LeftoverKind`]) and of shared object ([`ObjectKind`]), one
//! [`Leftover`] type (what it is, whose, why it may go), a [`scan()`] that lists them and a
//! [`remove()`] that removes what a scan listed, each checked again right before it goes, and
//! reports exactly what went. The rules themselves are the layers' own, each judged and applied
//! where the state lives: the registry's recovery ([`Registry::reclaim_dead_listed`]) and its
//! abandoned creations ([`registry::remove_abandoned`]); the channel's dead producers, dead
//! consumers, abandoned creations and host pools ([`channel::reclaim`]); the tensor sets' dead
//! writers' parts, abandoned creations, dead readers and dead holders' slots
//! ([`tensorset::reclaim`]); the quota
//! ledgers' dead holders ([`QuotaLedger::dead_holders`]) and abandoned creations
//! ([`quota::remove_abandoned`]); the liveness files ([`identity`]) and fd server
//! sockets ([`fdpass`]) of killed processes; the status files of killed lane bridges. This module
//! only lists and dispatches: it never reads a segment's bytes itself.
//!
//! What it never touches: anything of a live process or of one whose liveness cannot be told
//! (kept, with a note), a creation that may still be finished (a registry's, channel's or quota
//! ledger's younger than 2 s or whose creator runs: kept, with a note, never a problem), another
//! user's files (unless run as root, for per-process files: each passed over is listed, whether
//! the scope names it or not, [`others`], [`Scan::skipped`], never a problem), a
//! finished registry or a ready quota ledger itself (only what dead processes left inside them), and
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

use crate::channel::inspect as channel_inspect;
use crate::error::Error;
use crate::identity::{self, LivenessFile, ProcessIdentity};
use crate::ipc::fdpass::StaleSocketFile;
use crate::quota;
use crate::shm::SHM_DIR;
use crate::tensorset::reclaim::Part;
#[cfg(doc)]
use crate::{channel, ipc::fdpass, quota::QuotaLedger, registry, registry::Registry, tensorset};
use std::fmt;

mod holders;
mod remove;
mod scan;

pub use remove::remove;
pub use scan::{others, scan};

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
    /// Every kind, in the order [`scan()`] visits them.
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
    /// A quota ledger segment whose creation was abandoned half-way (empty or sparse, or never
    /// stamped with its creator dead, each for at least 2 s): the rule
    /// [`QuotaLedger::set_budget`] replaces one by ([`quota::abandoned`]).
    QuotaCreation,
    /// A killed lane bridge's status file (`/dev/shm/cuda-ipc.br.*`).
    BridgeStatus,
}

impl LeftoverKind {
    /// The kind of shared object it is part of; `None` for per-process files and for the quota
    /// ledgers' leftovers (dead holders, abandoned creations).
    pub fn object_kind(self) -> Option<ObjectKind> {
        ObjectKind::ALL
            .iter()
            .copied()
            .find(|k| k.leftover_kinds().contains(&self))
    }
}

/// One thing a dead process left, as [`scan()`] found it.
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
    /// What identifies it for [`remove()`].
    target: Target,
}

impl Leftover {
    /// Whether removing this leftover removes `/dev/shm` segment `seg` (a host pool, or a part of
    /// a tensor set): a ledger's dead holder whose host memory is in `seg` is freed after it.
    fn removes_segment(&self, seg: &str) -> bool {
        match self.target {
            Target::HostPool => {
                seg.strip_prefix(crate::channel::inspect::POOL_PREFIX) == Some(self.object.as_str())
            }
            Target::TensorSetPart(p) => p.segment_name(&self.object) == seg,
            _ => false,
        }
    }
}

impl fmt::Display for Leftover {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.what)
    }
}

/// What [`remove()`] needs to find a leftover again.
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
    /// A quota ledger creation abandoned half-way, judged again by
    /// [`quota::remove_abandoned`].
    QuotaCreation,
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

/// Something [`scan()`] or [`remove()`] could not read or remove: it stays, and is a problem.
#[derive(Debug)]
#[non_exhaustive]
pub struct Problem {
    /// What it concerns, e.g. `registry NAME`, `channel NAME`, `quota ledger NAME`, `fd server
    /// sockets`.
    pub subject: String,
    /// What went wrong. (Another user's object is no problem: [`Scan::skipped`].)
    pub error: Error,
}

/// What [`scan()`] found.
#[derive(Debug, Default)]
#[non_exhaustive]
pub struct Scan {
    /// The leftovers, in the order [`remove()`] takes them.
    pub leftovers: Vec<Leftover>,
    /// What is kept, one line each saying why (`channel X: ...`): whether its process runs cannot
    /// be told, a registry's, channel's or quota ledger's creation may still finish (younger
    /// than 2 s, or its creator runs), or a liveness file's lock is free but the file is younger
    /// than [`identity::LIVENESS_FILE_GRACE`] (its process may be starting).
    pub kept: Vec<String>,
    /// What could not be read.
    pub problems: Vec<Problem>,
    /// Other users' objects passed over, sorted by name, whether the scope names them or not
    /// ([`others`], and other users' quota ledgers): never judged nor removed, theirs to clean;
    /// no problem.
    pub skipped: Vec<Skipped>,
}

/// An object of another user that [`scan()`] passes over ([`others`]): a segment under this crate's
/// names (a registry, a channel's segment or host pool, a tensor set's part, a quota ledger), or
/// a file a killed process of that user left (a liveness file, an fd server socket, a bridge
/// status file). A segment is not judged (another user's segment is opened by no one, root
/// included: whether its processes run is not read), a file only as far as its listing reads
/// it; neither is removed. Theirs to clean, with a `cuda-ipc gc` run as that user; listed so that
/// a caller says what it left and whose it is. The same whether the scope names the object or
/// not: another user's object named is passed over as in a scan of everything, no problem.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Skipped {
    /// Its name in `/dev/shm`.
    pub name: String,
    /// The uid that owns it.
    pub uid: u32,
    /// What it is, in words: `registry`, `channel segment`, `host pool`, `tensor set part`,
    /// `quota ledger`, `liveness file`, `fd server socket` or `bridge status file`; under a
    /// channel's, host pool's or tensor set part's name, what stands there when it is no segment
    /// (`FIFO`, `directory`, `symbolic link`, `socket`, ...).
    pub what: &'static str,
    /// Whether its listing found it a dead process's leftover (a liveness file whose lock is free,
    /// an fd server socket of a dead process, a dead bridge's status file: what `gc` removes of
    /// this user's); `false` for a segment, which is not judged.
    pub dead: bool,
    /// The dead process a liveness file or fd server socket names; `None` otherwise.
    pub owner: Option<ProcessIdentity>,
}

/// What [`remove()`] did.
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

/// What [`scan()`] looks at.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scope {
    /// Registry segment names; `None`: every registry in `/dev/shm`.
    registries: Option<Vec<String>>,
    /// Channel names; `None`: every channel in `/dev/shm`.
    channels: Option<Vec<String>>,
    /// Tensor set names; `None`: every tensor set in `/dev/shm`.
    tensor_sets: Option<Vec<String>>,
    /// Quota ledger segment names (dead holders, abandoned creations); `None`: every ledger in
    /// `/dev/shm`.
    quota_ledgers: Option<Vec<String>>,
    /// Also the per-process files (liveness files, fd server sockets, bridge status files).
    process_files: bool,
}

impl Scope {
    /// Everything: every registry, channel and tensor set in `/dev/shm`, the quota ledgers' dead
    /// holders and abandoned creations, and the liveness files, fd server sockets and bridge
    /// status files of killed processes.
    pub fn everything() -> Scope {
        Scope {
            registries: None,
            channels: None,
            tensor_sets: None,
            quota_ledgers: None,
            process_files: true,
        }
    }

    /// Only these registries (segment names) and channels (channel names), and the host pools of
    /// those channels. Those of other users are passed over as [`Scope::everything`] passes over
    /// theirs, into [`Scan::skipped`] ([`others`]), never inspected.
    pub fn only(registries: Vec<String>, channels: Vec<String>) -> Scope {
        Scope {
            registries: Some(registries),
            channels: Some(channels),
            tensor_sets: Some(Vec::new()),
            quota_ledgers: Some(Vec::new()),
            process_files: false,
        }
    }

    /// Also these tensor sets (names) in a scope made by [`Scope::only`]. A set of which every
    /// part that stands is another user's is passed over, into [`Scan::skipped`]; another user's
    /// part beside a part of this user's is listed there too, and the set is scanned (that part
    /// is its problem).
    pub fn with_tensor_sets(mut self, names: Vec<String>) -> Scope {
        self.tensor_sets = Some(names);
        self
    }

    /// Also these quota ledgers (segment names, `cuda-ipc.quota.…`: [`quota::LEDGER_PREFIX`]) in
    /// a scope made by [`Scope::only`]: their dead holders' reservations, or the ledger itself
    /// when it is this user's creation abandoned half-way, by the rules of [`Scope::everything`]
    /// (another user's is passed over, into [`Scan::skipped`]). A name without the prefix is a
    /// problem of the scan ([`Error::InvalidArgument`]).
    pub fn with_quota_ledgers(mut self, names: Vec<String>) -> Scope {
        self.quota_ledgers = Some(names);
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

/// Whether `e` says that nothing stands under the name that was read: a missing segment
/// ([`ShmError::NotFound`](crate::shm::ShmError::NotFound)), or the same in a layer's words (no
/// channel of that name, [`ChannelError::NotFound`](crate::channel::ChannelError::NotFound); no
/// tensor set, [`TensorSetError::NotFound`](crate::tensorset::TensorSetError::NotFound)).
///
/// For tools that list names first and read each one after ([`scan()`], `cuda-ipc ls`): an object
/// whose reading fails so was closed (normally, by its owner) in between, which is no problem.
///
/// # Examples
/// ```
/// let e = cuda_ipc::channel::inspect::inspect("no-such-channel-anywhere").unwrap_err();
/// assert!(cuda_ipc::cleanup::is_gone(&e));
/// ```
pub fn is_gone(e: &Error) -> bool {
    crate::tensorset::is_not_found(e)
}

fn problem(subject: String, error: Error) -> Problem {
    Problem { subject, error }
}

impl Scan {
    /// Records that `subject` could not be read because of `error`: a problem, unless nothing
    /// stands under its name any more ([`is_gone`]: closed normally between the
    /// listing and the reading), which is no problem and is not reported.
    fn unread(&mut self, subject: String, error: Error) {
        if !is_gone(&error) {
            self.problems.push(problem(subject, error));
        }
    }
}

impl Removal {
    /// Records that removing the leftovers `listed` of `subject` failed with `error`: a problem,
    /// unless nothing stands under the name any more ([`is_gone`]: closed since the
    /// scan), when each of them not yet reported is kept, gone meanwhile.
    fn failed<'a>(
        &mut self,
        subject: String,
        error: Error,
        listed: impl IntoIterator<Item = &'a Leftover>,
    ) {
        if !is_gone(&error) {
            self.problems.push(problem(subject, error));
            return;
        }
        for l in listed {
            if !self.removed.contains(l) && !self.kept.iter().any(|(k, _)| k == l) {
                self.kept.push((l.clone(), "gone meanwhile"));
            }
        }
    }
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

fn holder_leftover(ledger: &str, h: &quota::Holder) -> Leftover {
    leftover(
        LeftoverKind::QuotaHolder,
        ledger,
        Some(h.identity),
        Some(h.uid),
        format!(
            "the reservation of {} of dead {} in quota ledger {ledger}",
            crate::error::bytes(h.bytes),
            h.identity
        ),
        Target::QuotaHolder {
            identity: h.identity,
            bytes: h.bytes,
        },
    )
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

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::quota::layout::{Header, LEDGER_LEN, MAGIC, VERSION};
    use std::time::{Duration, Instant, SystemTime};

    /// A user ledger's name of this process and `tag`, as `QuotaScope::segment_name` makes one.
    fn ledger_name(tag: u8) -> String {
        format!(
            "cuda-ipc.quota.u{}.fec1{tag:02x}{:026x}",
            rustix::process::geteuid().as_raw(),
            std::process::id()
        )
    }

    fn exists(name: &str) -> bool {
        std::fs::symlink_metadata(format!("{SHM_DIR}/{name}")).is_ok()
    }

    /// Removes a name in /dev/shm when dropped, whatever the test left.
    struct Gone(String);
    impl Drop for Gone {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(format!("{SHM_DIR}/{}", self.0));
        }
    }

    /// Plants under `name` what a `set_budget` killed half-way leaves: with `creator`, the whole
    /// ledger (every page written) with its magic, version and creator, never stamped; without,
    /// an empty file (killed before `ftruncate`).
    fn plant(name: &str, creator: Option<ProcessIdentity>) {
        use std::io::Write as _;
        use std::os::unix::fs::OpenOptionsExt as _;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(format!("{SHM_DIR}/{name}"))
            .unwrap();
        let Some(c) = creator else { return };
        let mut b = vec![0u8; LEDGER_LEN];
        b[..8].copy_from_slice(&MAGIC.to_le_bytes());
        let v = std::mem::offset_of!(Header, version);
        b[v..v + 4].copy_from_slice(&VERSION.to_le_bytes());
        let at = std::mem::offset_of!(Header, creator);
        for (i, w) in c.to_words().iter().enumerate() {
            b[at + 8 * i..at + 8 * (i + 1)].copy_from_slice(&w.to_le_bytes());
        }
        f.write_all(&b).unwrap();
    }

    /// The identity of a process that ran and was killed (a child of this test).
    fn dead_process() -> ProcessIdentity {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let start = identity::start_time_of(child.id())
            .unwrap()
            .expect("the child runs");
        child.kill().unwrap();
        child.wait().unwrap();
        let dead = ProcessIdentity {
            pid: child.id(),
            start_time: start,
            ..ProcessIdentity::current().unwrap()
        };
        assert_eq!(dead.liveness(), identity::Liveness::Dead);
        dead
    }

    /// Waits until the next whole second has begun: a file made then stays younger than the
    /// grace (2 s, counted in whole seconds of `st_ctime`) for almost 2 s.
    fn at_a_second_start() -> Instant {
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap();
        std::thread::sleep(Duration::from_nanos(
            1_000_000_000 - u64::from(now.subsec_nanos()) + 20_000_000,
        ));
        Instant::now()
    }

    #[test]
    fn quota_ledger_leftovers_belong_to_no_object_kind() {
        for k in [LeftoverKind::QuotaHolder, LeftoverKind::QuotaCreation] {
            assert_eq!(k.object_kind(), None, "{k:?}");
            assert!(
                ObjectKind::ALL
                    .iter()
                    .all(|o| !o.leftover_kinds().contains(&k)),
                "{k:?}"
            );
        }
    }

    #[test]
    fn an_abandoned_quota_ledger_creation_is_a_leftover_that_goes_and_a_young_or_live_one_is_kept()
    {
        let [empty, dead, live, young, young_empty] = [1, 2, 3, 4, 5].map(ledger_name);
        let _g = [&empty, &dead, &live, &young, &young_empty].map(|n| Gone(n.clone()));
        let dead_creator = dead_process();
        plant(&empty, None);
        plant(&dead, Some(dead_creator));
        plant(&live, Some(ProcessIdentity::current().unwrap()));
        // Past the grace (2 s, in whole seconds of `st_ctime`).
        std::thread::sleep(Duration::from_millis(2200));
        let planted = at_a_second_start();
        plant(&young, Some(dead_creator));
        plant(&young_empty, None);

        let scan = scan(&Scope::everything()).unwrap();
        let young_yet = planted.elapsed() < Duration::from_millis(1900);
        let names = [&empty, &dead, &live, &young, &young_empty];
        let mine = |o: &str| names.iter().any(|n| n.as_str() == o);
        let found: Vec<&Leftover> = scan.leftovers.iter().filter(|l| mine(&l.object)).collect();
        let kinds: Vec<(LeftoverKind, &str)> =
            found.iter().map(|l| (l.kind, l.object.as_str())).collect();
        // The young ones come of age only if the scan took almost 2 s (a slow machine).
        let late = |n: &str| !young_yet && (n == young || n == young_empty);
        assert!(
            kinds.len() >= 2
                && kinds[..2]
                    == [
                        (LeftoverKind::QuotaCreation, empty.as_str()),
                        (LeftoverKind::QuotaCreation, dead.as_str()),
                    ]
                && kinds[2..]
                    .iter()
                    .all(|&(k, n)| k == LeftoverKind::QuotaCreation && late(n)),
            "{found:#?}"
        );
        assert_eq!(found[0].owner, None);
        assert_eq!(found[1].owner, Some(dead_creator));
        assert_eq!(
            found[0].what,
            format!(
                "quota ledger {empty}: segment {SHM_DIR}/{empty}: a creation abandoned before its \
                 pages were reserved"
            )
        );
        assert!(
            found[1]
                .what
                .ends_with("a creation abandoned by its dead creator before its init stamp"),
            "{}",
            found[1].what
        );
        // Not problems: kept, with why.
        assert!(
            !scan
                .problems
                .iter()
                .any(|p| mine(p.subject.trim_start_matches("quota ledger "))),
            "{:?}",
            scan.problems
        );
        let kept = |n: &str| {
            scan.kept
                .iter()
                .find(|k| k.starts_with(&format!("quota ledger {n}: ")))
                .cloned()
        };
        let live_kept = kept(&live).expect("a live creator's creation is kept");
        assert!(
            live_kept.contains(&format!("by pid {}, which runs", std::process::id())),
            "{live_kept}"
        );
        if young_yet {
            for n in [&young, &young_empty] {
                let k = kept(n).expect("a young creation is kept");
                assert!(k.contains("a creation under way"), "{k}");
            }
        }

        // Removed only while the name still stands for what was judged: `empty` is made again
        // (young) before the removal, and stays.
        std::fs::remove_file(format!("{SHM_DIR}/{empty}")).unwrap();
        plant(&empty, None);
        let listed: Vec<Leftover> = found.iter().map(|l| (*l).clone()).collect();
        let r = remove(&listed[..2]);
        assert_eq!(r.removed, vec![listed[1].clone()], "{r:?}");
        assert_eq!(r.kept, vec![(listed[0].clone(), "gone or no longer stale")]);
        assert!(r.problems.is_empty(), "{:?}", r.problems);
        assert!(exists(&empty) && !exists(&dead) && exists(&live) && exists(&young));
        // Gone: nothing to do.
        let r = remove(&listed[1..2]);
        assert!(r.removed.is_empty() && r.kept.len() == 1, "{r:?}");
    }
}
