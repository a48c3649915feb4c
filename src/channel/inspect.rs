//! Read-only inspection of channel control segments, for tools (`cuda-ipc ls`, `watch`, `gc`).
//!
//! Owns: finding channels in `/dev/shm` ([`list_channels`]), copying out the state of one
//! ([`inspect`]), and judging, without changing anything, what dead processes left: a creation
//! abandoned half-way ([`abandoned`]) and host pool segments left without a live producer
//! ([`stale_host_pools`]). Removing those is [`super::reclaim`]'s.
//! Inspecting opens and validates the segment like a consumer does (magic, layout version, sizes,
//! owner) but never attaches, holds, releases or wakes: it only loads, so it cannot disturb the
//! protocol. Never calls CUDA.

use super::Delivery;
use super::control::{self, Control};
use super::layout::{self, META_BYTES, SEQ_EMPTY, WRITING};
use super::stats::LatencyHistogram;
use crate::error::{Error, Result};
use crate::identity::{Liveness, ProcessIdentity};
#[cfg(doc)]
use crate::shm::ShmError;
use crate::shm::versioned::Creation;
use crate::sync::Ordering;
use crate::token::{Token, TokenKind};

/// The wire codes a snapshot reads: the gate's state, a consumer slot's state, the producer's
/// state, and the code a build does not know (docs/channel-layout.md).
pub use super::layout::{ConsumerState, GateState, ProducerState, UnknownCode};

/// The prefix of every channel's segment name: channel `NAME` lives in `/dev/shm/cuda-ipc.ch.NAME`.
pub const SEGMENT_PREFIX: &str = layout::SEGMENT_PREFIX;

/// The segment name of channel `channel` (`cuda-ipc.ch.` followed by the channel name).
pub fn segment_name(channel: &str) -> String {
    control::segment_name(channel)
}

/// The prefix of a host channel's pool segment: channel `NAME` of [`super::MemoryKind::Host`]
/// keeps its buffers in `/dev/shm/cuda-ipc.hp.NAME`.
pub const POOL_PREFIX: &str = super::host::POOL_PREFIX;

/// The pool segment name of host channel `channel` (`cuda-ipc.hp.` followed by the channel name).
pub fn pool_segment_name(channel: &str) -> String {
    super::host::pool_name(channel)
}

/// Host pool segments of this user that a dead producer or an abandoned creation left:
/// (channel name, why it may go): the pools [`host_pools`] judges [`PoolJudgement::Stale`]. A
/// pool of a live producer, another user's, or anything else under such a name (a FIFO, a
/// foreign file) is never listed here ([`host_pools`] says what each is).
///
/// # Errors
/// [`Error::Os`] when `/dev/shm` cannot be read.
pub fn stale_host_pools() -> Result<Vec<(String, &'static str)>> {
    Ok(host_pools()?
        .into_iter()
        .filter_map(|p| match p.judgement {
            PoolJudgement::Stale(why) => Some((p.channel, why)),
            _ => None,
        })
        .collect())
}

/// What `cuda-ipc gc` makes of a name `cuda-ipc.hp.NAME` of this user ([`host_pools`]), by the
/// rule a new host producer of channel `NAME` replaces what stands there by.
#[derive(Debug)]
#[non_exhaustive]
pub enum PoolJudgement {
    /// A dead producer's pool, or a creation abandoned half-way: `gc` removes it, why in words.
    Stale(&'static str),
    /// Kept, with why: a live producer's pool, a creation that may still be finished (younger
    /// than 2 s, being sized, or not stamped yet by a producer that runs), or the pool of a
    /// channel of another layout version (never judged by this build: its channel says so).
    Kept(String),
    /// What stands under the name is nothing this build may judge (a file that is not a pool, a
    /// FIFO, a directory, a symbolic link, a pool of another version, one open to other users,
    /// another user's): kept, never removed, and a problem of `ls` and `gc`. It blocks a host
    /// producer of that channel, whose creation fails with this error.
    Unjudged(Error),
}

/// A name `cuda-ipc.hp.NAME` of this user and what `gc` makes of it ([`host_pools`]).
#[derive(Debug)]
#[non_exhaustive]
pub struct HostPoolEntry {
    /// The channel name (`NAME`).
    pub channel: String,
    /// The pool's segment name (`cuda-ipc.hp.NAME`).
    pub segment: String,
    /// Its size in bytes (0 for anything but a regular file).
    pub bytes: u64,
    /// Seconds since its last status change (`st_ctime`; 0 for anything but a regular file).
    pub age_secs: u64,
    /// Whether anything stands under its channel's control segment name (`cuda-ipc.ch.NAME`):
    /// then that channel's listing speaks for a pool [`PoolJudgement::Kept`] or
    /// [`PoolJudgement::Stale`] (its producer's), and a pool without one is an orphan.
    pub with_channel: bool,
    /// What `gc` makes of it.
    pub judgement: PoolJudgement,
}

/// Names of the channels with a host pool name of this user in `/dev/shm` (`cuda-ipc.hp.NAME`,
/// whatever stands there: a pool, or a FIFO, directory or link that blocks one), sorted, whether
/// their control segment stands or not. What each is: [`host_pool`].
///
/// # Errors
/// [`Error::Os`] when `/dev/shm` cannot be listed.
pub fn list_host_pools() -> Result<Vec<String>> {
    Ok(crate::shm::list_own_names()?
        .into_iter()
        .filter_map(|s| s.strip_prefix(POOL_PREFIX).map(str::to_string))
        .filter(|n| !n.is_empty())
        .collect())
}

/// Every host pool name of this user ([`list_host_pools`]), each judged by [`host_pool`];
/// changes nothing. For `cuda-ipc ls` and `gc`: whatever blocks a host producer's creation is
/// shown and reported, and only what is ours and judged abandoned (a dead producer's pool, a
/// creation abandoned half-way) is removed.
///
/// # Errors
/// [`Error::Os`] when `/dev/shm` cannot be listed.
pub fn host_pools() -> Result<Vec<HostPoolEntry>> {
    Ok(list_host_pools()?
        .into_iter()
        .filter_map(|c| host_pool(&c))
        .collect())
}

/// The host pool name of channel `channel` and what `gc` makes of it, by the rule a new host
/// producer replaces what stands there by; `None` when nothing stands under the name (or the
/// channel name is not one). Changes nothing; never maps anything that is not a regular file of
/// this user with its pages, and never waits for a stamp nobody will write.
pub fn host_pool(channel: &str) -> Option<HostPoolEntry> {
    super::validate_name_as(channel, "channel name").ok()?;
    let segment = pool_segment_name(channel);
    let stat = crate::shm::Segment::stat(&segment);
    if matches!(&stat, Err(e) if super::is_not_found(e)) {
        return None;
    }
    let (bytes, age_secs) = stat.as_ref().map_or((0, 0), |i| (i.len, i.age_secs));
    let judgement = match super::host::HostPool::replaceable(channel) {
        Ok(why) => PoolJudgement::Stale(why),
        // Gone since the stat.
        Err(e) if super::is_not_found(&e) => return None,
        Err(Error::Channel(super::ChannelError::AlreadyExists { pid, .. })) => {
            PoolJudgement::Kept(format!("its producer (pid {pid}) runs"))
        }
        Err(Error::Channel(super::ChannelError::CreationInProgress(_))) => {
            PoolJudgement::Kept(POOL_UNDER_WAY.to_string())
        }
        Err(Error::Channel(super::ChannelError::VersionMismatch { found, .. })) => {
            PoolJudgement::Kept(format!(
                "its channel has layout version {found}, which this build does not judge"
            ))
        }
        Err(e) => PoolJudgement::Unjudged(e),
    };
    let with_channel =
        std::fs::symlink_metadata(format!("{}/{}", crate::shm::SHM_DIR, segment_name(channel)))
            .is_ok();
    Some(HostPoolEntry {
        channel: channel.to_string(),
        segment,
        bytes,
        age_secs,
        with_channel,
        judgement,
    })
}

/// Why a pool that may still be finished is kept, in words.
const POOL_UNDER_WAY: &str = "a creation under way: younger than 2 s, being sized, or not \
                              stamped yet by a producer that runs; judged again later";

/// What a buffer of the pool holds.
///
/// In the `serde` form of [`BufferSnapshot`] it is two keys: `state` (`"empty"`, `"writing"` or
/// `"frame"`) and `seq` (the frame's sequence number, `null` for the other two).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum BufferState {
    /// Nothing published in it yet (or its frame was given up unpublished).
    Empty,
    /// The producer is writing it (or withdrew it at close).
    Writing,
    /// The frame with this sequence number.
    Frame(u64),
}

/// One buffer of the pool, as it was when copied.
///
/// With the `serde` feature it serialises as one flat object: `index`, `state` and `seq` (see
/// [`BufferState`]), `holders` (the consumer slot indices of `hold_mask`, as a list),
/// `used_mask`, `metadata_bytes` (`meta_len`), and from the memory token `bytes` (its length)
/// and `device` (the device UUID, or `"host"` for a host-memory pool), both `null` when the
/// token does not decode.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct BufferSnapshot {
    /// The buffer index in the pool.
    pub index: usize,
    /// What it holds.
    #[cfg_attr(
        feature = "serde",
        serde(flatten, serialize_with = "json::buffer_state")
    )]
    pub state: BufferState,
    /// Consumers (bit = consumer slot index) holding its frame now.
    #[cfg_attr(
        feature = "serde",
        serde(rename = "holders", serialize_with = "json::slots_of_mask")
    )]
    pub hold_mask: u64,
    /// Consumers that read it since the producer last wrote it (the next write waits on their
    /// release events).
    pub used_mask: u64,
    /// Bytes of user metadata stored with its frame (at most [`super::META_BYTES`]).
    #[cfg_attr(feature = "serde", serde(rename = "metadata_bytes"))]
    pub meta_len: u32,
    /// Its memory token, decoded (device UUID, range, exporter); `None` when the bytes do not
    /// decode.
    #[cfg_attr(feature = "serde", serde(flatten, serialize_with = "json::memory"))]
    pub memory: Option<Token>,
}

/// One consumer slot in use, as it was when copied.
///
/// With the `serde` feature it serialises as one flat object with its field names, except: the
/// fields of its [`ProcessIdentity`] but the boot id (`pid`, `start_time`, `pid_ns`) in place of
/// `identity`, `liveness` as `process`, and `state` and `delivery` as their words
/// ([`ConsumerState`], [`Delivery`]) or `"unknown(N)"` for a code this build does not know.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct ConsumerSnapshot {
    /// The consumer slot index (its bit in the hold masks).
    pub index: usize,
    /// `true` once attached; `false` while a consumer is still claiming the slot (its fields may be
    /// incomplete), or when its state code is unknown.
    pub attached: bool,
    /// The slot's state ([`ConsumerState::Claiming`] or [`ConsumerState::Active`]; free slots are
    /// not listed), or the code found when it is none this build knows.
    #[cfg_attr(feature = "serde", serde(serialize_with = "json::known_or_unknown"))]
    pub state: std::result::Result<ConsumerState, UnknownCode>,
    /// Its delivery policy; the code found when it is none this build knows (a corrupted slot, or
    /// a consumer of a newer version), which the protocol treats as neither policy: the producer
    /// does not wait for it and it takes frames in order.
    #[cfg_attr(feature = "serde", serde(serialize_with = "json::known_or_unknown"))]
    pub delivery: std::result::Result<Delivery, UnknownCode>,
    /// How many times the slot was claimed.
    pub generation: u64,
    /// Its process.
    #[cfg_attr(
        feature = "serde",
        serde(flatten, serialize_with = "crate::identity::snapshot_json::identity")
    )]
    pub identity: ProcessIdentity,
    /// Whether its process still runs; a dead consumer's holds are released by the producer.
    #[cfg_attr(feature = "serde", serde(rename = "process"))]
    pub liveness: Liveness,
    /// The last sequence number it received or skipped.
    pub cursor: u64,
    /// Frames received.
    pub received: u64,
    /// Frames skipped.
    pub dropped: u64,
    /// Buffers (pool indices) whose frames it holds now.
    pub holds: Vec<usize>,
    /// Frames published that it has not received or skipped yet: `head - cursor`.
    pub lag: u64,
    /// How its frames leave: 0 on this host, 1 a bridge sending them to another host
    /// (`layout::TRANSPORT_*`).
    pub transport: u32,
    /// Its hand-offs by latency, publish to take.
    pub latency: LatencyHistogram,
}

/// The state of a channel, copied from its control segment.
///
/// Fields are read one by one with atomic loads: on a busy channel they may belong to slightly
/// different moments (a frame counted as published may not show as held yet).
///
/// With the `serde` feature it serialises with its field names (`cuda-ipc ls --json` prints this
/// form), except: `producer` as `producer_pid` (the pid only), `producer_liveness` as
/// `producer`, and `producer_state` as `state` (`"open"`, `"closed"`, or `"unknown(N)"` for a code
/// this build does not know).
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct ChannelSnapshot {
    /// The channel name.
    pub name: String,
    /// The segment name (`cuda-ipc.ch.NAME`, in `/dev/shm`).
    pub segment: String,
    /// The segment's size in bytes.
    pub segment_bytes: u64,
    /// The segment's creation generation (random, nonzero; another value behind the same name
    /// means the channel was made again).
    pub generation: u64,
    /// Bytes per buffer of the pool.
    pub buffer_bytes: u64,
    /// The most consumers that can attach at once.
    pub consumer_capacity: usize,
    /// The producer process.
    #[cfg_attr(
        feature = "serde",
        serde(rename = "producer_pid", serialize_with = "json::pid")
    )]
    pub producer: ProcessIdentity,
    /// Whether the producer still runs.
    #[cfg_attr(feature = "serde", serde(rename = "producer"))]
    pub producer_liveness: Liveness,
    /// Whether the producer closed the channel.
    pub closed: bool,
    /// The producer's state code as read: open or closed, or the code found when it is none this
    /// build knows (the protocol treats such a channel as open).
    #[cfg_attr(
        feature = "serde",
        serde(rename = "state", serialize_with = "json::known_or_unknown")
    )]
    pub producer_state: std::result::Result<ProducerState, UnknownCode>,
    /// Sequence number of the latest frame (0: none yet).
    pub head: u64,
    /// Frames published.
    pub published: u64,
    /// Holds the producer released on behalf of dead consumers or at shutdown.
    pub forced_releases: u64,
    /// The pool, in index order.
    pub buffers: Vec<BufferSnapshot>,
    /// Consumer slots in use, in index order.
    pub consumers: Vec<ConsumerSnapshot>,
    /// Whether the channel hands buffers out in ring order (`ChannelOptions::ring`).
    pub ring: bool,
    /// How its frames arrive: 0 written on this host, 1 a bridge filling it from another host
    /// (`layout::TRANSPORT_*`).
    pub transport: u32,
    /// For a host channel ([`super::MemoryKind::Host`]), why its pool `cuda-ipc.hp.NAME` cannot
    /// be used, as a consumer's attach finds it (missing, cut short of its buffers, sparse,
    /// another creation, a FIFO, ...: the attach fails with this error); `None` when it can,
    /// and for a channel whose buffers are device memory. Checked without reading past the
    /// file's size: the pool is mapped only once its length and pages are checked, and only its
    /// header is read.
    pub pool_problem: Option<String>,
}

impl ChannelSnapshot {
    /// Whether dead processes left something here: a dead producer (the segment is garbage, see
    /// [`super::reclaim::remove_stale`]) or dead consumers (the producer releases their holds when it next needs a
    /// buffer).
    pub fn has_leftovers(&self) -> bool {
        self.producer_liveness == Liveness::Dead
            || self.consumers.iter().any(|c| c.liveness == Liveness::Dead)
    }
}

/// Names of the channels whose control segments are in `/dev/shm` (names `cuda-ipc.ch.NAME`) and
/// belong to this process's effective user (only those can be opened: see [`inspect`]), sorted,
/// whatever stands under the name: a FIFO, a directory or a symbolic link there blocks the
/// channel's creation, so it is listed, and [`inspect`] says what it is
/// ([`ShmError::NotASegment`]). Whether each is valid is for [`inspect`] to say.
///
/// # Errors
/// [`Error::Os`] when `/dev/shm` cannot be listed.
pub fn list_channels() -> Result<Vec<String>> {
    Ok(crate::shm::list_own_names()?
        .into_iter()
        .filter_map(|s| s.strip_prefix(SEGMENT_PREFIX).map(str::to_string))
        .filter(|n| !n.is_empty())
        .collect())
}

/// Copies the state of channel `channel` from its control segment, without attaching.
///
/// Validates the segment as a consumer does (owner, magic, layout version, counts and sizes), but
/// waits for its init stamp (up to 2 s) only while a creator may still write it: one recorded
/// that runs (or whose liveness cannot be told), or none recorded yet in a segment younger than
/// 2 s. A segment without its stamp whose creator is dead, or that records none and is older, is
/// a creation abandoned half-way, told at once ([`super::SegmentFault::Abandoned`]): `cuda-ipc
/// ls`, `watch`, `metrics` and `gc` never wait on one (nor does a consumer's attach).
///
/// # Errors
/// - [`super::ChannelError::NotFound`] when there is no such segment;
/// - [`super::ChannelError::BadSegment`] for a foreign, truncated or corrupted segment, a
///   creation abandoned half-way ([`super::SegmentFault::Abandoned`], at once), one whose
///   stamp is still 0 after 2 s though its producer runs and had recorded itself at least
///   500 ms before (a header overwritten, not a creation in progress:
///   [`super::SegmentFault::Overwritten`]), or one whose creator may still write it but did not
///   stamp it within 2 s ([`super::SegmentFault::Unfinished`]);
/// - [`super::ChannelError::VersionMismatch`] for another layout version;
/// - [`ShmError::WrongOwner`] for another user's segment, [`ShmError::InsecureMode`] for one
///   open to other users (any of the mode bits `0o007`), [`ShmError::InvalidName`] for
///   a name that cannot be a segment name, [`ShmError::TooSmall`] for one shorter than a
///   header;
/// - [`Error::Os`] when a call fails.
///
/// # Examples
/// ```
/// use cuda_ipc::channel::inspect;
/// use cuda_ipc::raw::channel::testing::ControlProducer;
/// let name = format!("doc-inspect-{}", std::process::id());
/// let tokens = [[0u8; cuda_ipc::token::TOKEN_LEN]];
/// let tx = ControlProducer::create(&name, 4096, 2, &tokens)?;
/// let (i, _) = tx.try_acquire().unwrap();
/// tx.publish(i, b"frame 1")?;
/// let snap = inspect::inspect(&name)?;
/// assert_eq!((snap.head, snap.buffers[0].state), (1, inspect::BufferState::Frame(1)));
/// tx.unlink();
/// # Ok::<(), cuda_ipc::Error>(())
/// ```
pub fn inspect(channel: &str) -> Result<ChannelSnapshot> {
    let mut first = true;
    loop {
        let c = Control::open_unless_abandoned_in(SEGMENT_PREFIX, channel)?;
        let mut snap = snapshot(channel, &c);
        snap.pool_problem = pool_problem(channel, &c);
        if snap.pool_problem.is_none() {
            return Ok(snap);
        }
        // A producer closing unlinks its control segment, then its pool (one made again makes
        // its pool, then its control segment): a pool gone or of another creation behind a
        // control segment whose name no longer stands for the one read is a channel closed
        // meanwhile (gone), or made again (read again, once), not a problem of this one.
        let now = crate::shm::Segment::stat(c.segment().name());
        match now {
            Err(e) if super::is_not_found(&e) => {
                return Err(super::ChannelError::NotFound(channel.to_string()).into());
            }
            Ok(i) if first && c.segment().inode().is_ok_and(|read| read != i.inode) => {
                first = false;
            }
            _ => return Ok(snap),
        }
    }
}

/// Why the host pool of `channel` (whose control segment is `c`) cannot be used, as a consumer's
/// attach opens it ([`super::host::HostPool::open`], with the tokens and the buffer size of the
/// control segment); `None` when it can, or when the channel's buffers are not host memory.
fn pool_problem(channel: &str, c: &Control) -> Option<String> {
    let first = Token::from_bytes(&c.buffer_token(0)).ok()?;
    if first.kind != TokenKind::HostMemory {
        return None;
    }
    let opened = (0..c.buffers())
        .map(|i| Token::from_bytes(&c.buffer_token(i)))
        .collect::<Result<Vec<_>>>()
        .and_then(|tokens| super::host::HostPool::open(channel, false, &tokens, c.buffer_bytes()));
    opened.err().map(|e| e.to_string())
}

/// [`inspect`] of the control segment `channel` under `prefix` (crate-private: a tensor set's
/// generation channel, `cuda-ipc.tg.NAME`).
pub(crate) fn inspect_in(prefix: &str, channel: &str) -> Result<ChannelSnapshot> {
    let c = Control::open_unless_abandoned_in(prefix, channel)?;
    Ok(snapshot(channel, &c))
}

pub(crate) fn snapshot(channel: &str, c: &Control) -> ChannelSnapshot {
    let stats = c.stats();
    let producer = c.producer();
    let head = c.head();
    let buffers: Vec<BufferSnapshot> = (0..c.buffers()).map(|i| buffer_snapshot(c, i)).collect();
    let consumers = (0..c.consumer_capacity())
        .filter_map(|k| consumer_snapshot(c, k))
        .map(|mut s| {
            let bit = 1u64 << s.index;
            s.holds = buffers
                .iter()
                .filter(|b| b.hold_mask & bit != 0)
                .map(|b| b.index)
                .collect();
            s.lag = head.saturating_sub(s.cursor);
            s
        })
        .collect();
    ChannelSnapshot {
        name: channel.to_string(),
        segment: c.segment().name().to_string(),
        segment_bytes: c.segment().len() as u64,
        generation: c.generation(),
        buffer_bytes: c.buffer_bytes(),
        consumer_capacity: c.consumer_capacity(),
        producer_liveness: c.producer_liveness(),
        producer,
        closed: c.is_closed(),
        producer_state: ProducerState::from_wire(c.producer_state()),
        head,
        published: stats.published,
        forced_releases: stats.forced_releases,
        buffers,
        consumers,
        ring: c.is_ring(),
        // Relaxed: a diagnostic copy.
        transport: c.header().transport.load(Ordering::Relaxed),
        // Looked at by `inspect`, for a host channel.
        pool_problem: None,
    }
}

/// Buffer `i` as it is now, read with loads only.
fn buffer_snapshot(c: &Control, i: usize) -> BufferSnapshot {
    let b = c.buffer_slot(i);
    // SYNC POINT: publish. Acquire: pairs with the Release store of `seq` in `Control::publish`,
    // as in `try_take`.
    let seq = b.seq.load(Ordering::Acquire);
    let mem = c.buffer_token(i);
    BufferSnapshot {
        index: i,
        state: match seq {
            SEQ_EMPTY => BufferState::Empty,
            WRITING => BufferState::Writing,
            s => BufferState::Frame(s),
        },
        // Relaxed: diagnostic copies; nothing is read through them.
        hold_mask: b.hold_mask.load(Ordering::Relaxed),
        used_mask: b.used_mask.load(Ordering::Relaxed),
        meta_len: b.meta_len.load(Ordering::Relaxed).min(META_BYTES as u32),
        memory: Token::from_bytes(&mem).ok(),
    }
}

/// Consumer slot `k` as it is now, `None` when free, read with loads only.
fn consumer_snapshot(c: &Control, k: usize) -> Option<ConsumerSnapshot> {
    let s = c.consumer_slot(k);
    // SYNC POINT: attach. Acquire: pairs with the Release store of ACTIVE in `Control::attach`:
    // the fields below are whole.
    let state = s.state.load(Ordering::Acquire);
    if state == layout::FREE {
        return None;
    }
    // Relaxed: diagnostic copies of a slot that may change at any time.
    let identity = c.consumer_identity(k);
    Some(ConsumerSnapshot {
        index: k,
        // A code other than ACTIVE (claiming, or unknown) is not attached, as for the protocol.
        attached: ConsumerState::from_wire(state) == Ok(ConsumerState::Active),
        state: ConsumerState::from_wire(state),
        delivery: Delivery::from_wire(s.policy.load(Ordering::Relaxed)),
        generation: s.generation.load(Ordering::Relaxed),
        liveness: identity.liveness_as(c.consumer_uid(k)),
        identity,
        cursor: s.cursor.load(Ordering::Relaxed),
        received: s.received.load(Ordering::Relaxed),
        dropped: s.dropped.load(Ordering::Relaxed),
        holds: Vec::new(),
        lag: 0,
        transport: s.transport.load(Ordering::Relaxed),
        latency: c.latency(k),
    })
}

/// Whether the segment of `channel` is a creation abandoned half-way: this user's, empty, sparse
/// or never stamped, at least 2 s old, with no live creator recorded (the rule by which a new
/// producer replaces it). Returns why, or `Ok(None)`: no such segment, a finished channel
/// (whatever its producer's state: that is [`super::reclaim::remove_stale`]'s), or one being created now.
///
/// # Errors
/// The typed errors that say what else is under the name and why it is kept
/// ([`ShmError::WrongOwner`], [`ShmError::InsecureMode`], [`ShmError::NotASegment`],
/// [`super::ChannelError::VersionMismatch`], ...).
pub fn abandoned(channel: &str) -> Result<Option<&'static str>> {
    let name = segment_name(channel);
    match Control::replaceable(channel, &name) {
        Ok("its producer is dead") => Ok(None),
        Ok(why) => Ok(Some(why)),
        // Nothing under the name (the opener tells it as `ChannelError::NotFound`).
        Err(e) if super::is_not_found(&e) => Ok(None),
        // A live producer's, a live creator's: not abandoned.
        Err(Error::Channel(
            super::ChannelError::AlreadyExists { .. } | super::ChannelError::CreationInProgress(_),
        )) => Ok(None),
        Err(e) => Err(e),
    }
}

/// [`abandoned`] for `gc`'s scan, without waiting, with a creation that may still be finished
/// told apart (young, or its producer may still stamp it: kept, not a problem) and a channel
/// stamped since the inspection looked ([`Creation::Finished`]: inspect it again). The rule is
/// the one a new producer replaces a segment by.
///
/// # Errors
/// As [`abandoned`], and [`ShmError::NotFound`] when nothing is under the name.
pub(crate) fn judge_creation(channel: &str) -> Result<Creation> {
    Control::judge_creation(channel, &segment_name(channel))
}

/// The `serde` forms of the snapshot fields whose JSON differs from the Rust value.
#[cfg(feature = "serde")]
mod json {
    use super::{BufferState, ProcessIdentity, UnknownCode};
    use crate::token::{Token, TokenKind};
    use serde::{Serialize, Serializer};

    /// `state` and `seq` keys (flattened into the buffer's object).
    pub(super) fn buffer_state<S: Serializer>(b: &BufferState, s: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Json {
            state: &'static str,
            seq: Option<u64>,
        }
        let (state, seq) = match *b {
            BufferState::Empty => ("empty", None),
            BufferState::Writing => ("writing", None),
            BufferState::Frame(seq) => ("frame", Some(seq)),
        };
        Json { state, seq }.serialize(s)
    }

    /// The consumer slot indices whose bit is set, in order.
    pub(super) fn slots_of_mask<S: Serializer>(mask: &u64, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq((0..64).filter(|k| mask & (1u64 << k) != 0))
    }

    /// `bytes` and `device` keys (flattened into the buffer's object), `null` when the token
    /// does not decode.
    pub(super) fn memory<S: Serializer>(t: &Option<Token>, s: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Json {
            bytes: Option<u64>,
            device: Option<String>,
        }
        Json {
            bytes: t.map(|t| t.len),
            device: t.map(|t| {
                if t.kind == TokenKind::HostMemory {
                    "host".to_string()
                } else {
                    t.device.to_string()
                }
            }),
        }
        .serialize(s)
    }

    /// The known value's own form, or `"unknown(N)"`.
    pub(super) fn known_or_unknown<T: Serialize, S: Serializer>(
        v: &Result<T, UnknownCode>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        match v {
            Ok(known) => known.serialize(s),
            Err(e) => s.collect_str(&format_args!("unknown({})", e.code)),
        }
    }

    /// The pid only.
    pub(super) fn pid<S: Serializer>(p: &ProcessIdentity, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u32(p.pid)
    }

    #[cfg(test)]
    mod tests {
        use super::super::{Delivery, ProducerState};
        use super::*;

        #[derive(Serialize)]
        struct Code<T: Serialize>(
            #[serde(serialize_with = "known_or_unknown")] Result<T, UnknownCode>,
        );

        #[test]
        fn a_code_this_build_does_not_know_is_written_unknown_never_as_a_known_word() {
            let word = |v: serde_json::Value| v.as_str().unwrap().to_string();
            assert_eq!(
                word(serde_json::json!(Code(Delivery::from_wire(0)))),
                "every-frame"
            );
            assert_eq!(
                word(serde_json::json!(Code(Delivery::from_wire(7)))),
                "unknown(7)"
            );
            assert_eq!(
                word(serde_json::json!(Code(ProducerState::from_wire(1)))),
                "closed"
            );
            assert_eq!(
                word(serde_json::json!(Code(ProducerState::from_wire(5)))),
                "unknown(5)"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::channel::WaitStrategy;
    use crate::shm::{Segment, SegmentOptions};
    use crate::token::{TOKEN_LEN, TokenKind};

    // The segment is driven through `Control` itself: `channel::testing` builds on this module,
    // so its `ControlProducer`, `ControlConsumer` and `token` are not used here (a circle).

    /// A producer's control segment with buffers of 4096 bytes and room for 4 consumers.
    fn producer(n: &str, tokens: &[[u8; TOKEN_LEN]]) -> Control {
        Control::create(n, 4096, 4, tokens, &SegmentOptions::new()).unwrap()
    }

    /// A consumer attached to channel `n`, detached when dropped.
    struct Rx {
        control: Control,
        slot: usize,
    }

    impl Rx {
        fn attach(n: &str, delivery: Delivery) -> Rx {
            let control = Control::open(n).unwrap();
            let slot = control.attach(delivery).unwrap();
            Rx { control, slot }
        }
        fn take(&self) -> Option<(usize, u64, Vec<u8>)> {
            self.control
                .take(self.slot, WaitStrategy::Block, None, &Default::default())
                .unwrap()
                .map(|(i, seq, m)| (i, seq, m.as_slice().to_vec()))
        }
        fn release(&self, i: usize) {
            self.control.release(self.slot, i)
        }
    }

    impl Drop for Rx {
        fn drop(&mut self) {
            self.control.detach(self.slot);
        }
    }

    fn token(i: u8) -> [u8; TOKEN_LEN] {
        Token {
            kind: TokenKind::LegacyMemory,
            handle: [i; 64],
            offset: 0,
            len: 4096,
            device: crate::driver::Uuid([7; 16]),
            exporter: ProcessIdentity::current().unwrap(),
            export_id: 0,
        }
        .to_bytes()
    }

    fn name(tag: &str) -> String {
        format!("inspect-{tag}-{}", std::process::id())
    }

    #[test]
    fn snapshot_shows_frames_holds_cursors_and_consumers_without_attaching() {
        let n = name("state");
        let tx = producer(&n, &[token(1), token(3)]);
        let rx = Rx::attach(&n, Delivery::EveryFrame);
        for _ in 0..2 {
            let i = tx.try_acquire().unwrap().index;
            tx.publish(i, b"meta").unwrap();
        }
        let (held, seq, _) = rx.take().unwrap();
        assert_eq!(seq, 1);
        let s = inspect(&n).unwrap();
        assert_eq!(s.segment, format!("cuda-ipc.ch.{n}"));
        assert_eq!((s.head, s.published, s.buffer_bytes), (2, 2, 4096));
        assert_eq!(s.producer.pid, std::process::id());
        assert_eq!(s.producer_liveness, Liveness::Alive);
        assert!(!s.closed && !s.has_leftovers());
        let mut states: Vec<_> = s.buffers.iter().map(|b| b.state).collect();
        states.sort_by_key(|st| format!("{st:?}"));
        assert_eq!(states, [BufferState::Frame(1), BufferState::Frame(2)]);
        assert_eq!(s.buffers[held].hold_mask, 1 << rx.slot);
        assert_eq!(s.buffers[held].meta_len, 4);
        assert_eq!(s.buffers[0].memory.unwrap().device.0, [7; 16]);
        assert_eq!(s.consumers.len(), 1);
        let c = &s.consumers[0];
        assert!(c.attached);
        assert_eq!((c.cursor, c.received, c.lag), (1, 1, 1));
        assert_eq!(c.holds, [held]);
        // Inspecting changed nothing: the next snapshot is identical.
        assert_eq!(inspect(&n).unwrap(), s);
        rx.release(held);
        drop(rx);
        assert!(inspect(&n).unwrap().consumers.is_empty());
        tx.close();
        assert!(inspect(&n).unwrap().closed);
        assert!(list_channels().unwrap().contains(&n));
        tx.unlink();
        assert!(!list_channels().unwrap().contains(&n));
    }

    #[test]
    fn unknown_policy_and_state_codes_are_reported_as_unknown_not_as_a_known_one() {
        let n = name("codes");
        let tx = producer(&n, &[token(1)]);
        let rx = Rx::attach(&n, Delivery::LatestOnly);
        let s = inspect(&n).unwrap();
        let c = &s.consumers[0];
        assert_eq!(c.delivery, Ok(Delivery::LatestOnly));
        assert_eq!((c.state, c.attached), (Ok(ConsumerState::Active), true));
        assert_eq!(s.producer_state, Ok(ProducerState::Open));
        let ctl = Control::open(&n).unwrap();
        let slot = ctl.consumer_slot(rx.slot);
        slot.policy.store(7, Ordering::Relaxed);
        slot.state.store(9, Ordering::Relaxed);
        ctl.header_for_tests()
            .producer_state
            .store(5, Ordering::Relaxed);
        let s = inspect(&n).unwrap();
        let c = &s.consumers[0];
        let unknown = |field, code| UnknownCode { field, code };
        assert_eq!(c.delivery, Err(unknown("policy", 7)));
        assert_eq!(c.state, Err(unknown("consumer state", 9)));
        assert!(!c.attached);
        assert_eq!(s.producer_state, Err(unknown("producer state", 5)));
        assert!(
            !s.closed,
            "an unknown producer state reads as open, as for the protocol"
        );
        slot.state.store(layout::ACTIVE, Ordering::Relaxed);
        drop(rx);
        tx.unlink();
    }

    #[test]
    fn foreign_and_truncated_segments_are_refused_with_a_clear_error() {
        let n = name("bad");
        let seg_name = segment_name(&n);
        let seg = Segment::create(&seg_name, 4096, &crate::shm::SegmentOptions::new()).unwrap();
        // SAFETY: the mapping is 4096 bytes, so its first 8 (page-aligned) are in bounds; nobody
        // else knows this segment.
        unsafe { (seg.as_ptr() as *mut u64).write_volatile(u64::from_le_bytes(*b"NOTCHANL")) };
        // Stamp READY so the opener does not wait for a creator.
        // SAFETY: as above, the stamp's offset is in bounds and 4-byte aligned.
        unsafe {
            (seg.as_ptr().add(layout::header::STAMP) as *mut u32)
                .write_volatile(layout::STAMP_READY)
        };
        let e = inspect(&n).unwrap_err().to_string();
        assert!(e.contains("not a cuda-ipc channel"), "{e}");
        Segment::unlink(&seg_name).unwrap();
        drop(seg);
        let seg = Segment::create(&seg_name, 16, &crate::shm::SegmentOptions::new()).unwrap();
        let e = inspect(&n).unwrap_err().to_string();
        assert!(e.contains("smaller than"), "{e}");
        Segment::unlink(&seg_name).unwrap();
        drop(seg);
        assert!(matches!(
            inspect(&n),
            Err(Error::Channel(super::super::ChannelError::NotFound(_)))
        ));
        assert!(inspect("no/slashes").is_err());
    }
}
