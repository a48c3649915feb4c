//! The channel's control block: a POSIX shared-memory segment holding the pool's tokens, each
//! buffer's state and holders, each consumer's cursor and counters, two futex words, and the GPU
//! words (ready, gate and release words) that the streams write and wait on.
//!
//! This file owns the segment: its name, creating it (replacing what a dead producer or an
//! abandoned creation left), opening and validating it, reaching its slots, noticing that its
//! name was superseded, and removing the name. The protocol on it: `handoff.rs` (acquire, publish,
//! take, release, close), `reserve.rs` (the producer's reservation of a pool of one buffer),
//! `hold.rs` (a buffer's holds, with their loom models) and `wait.rs` (futex waits). None of it calls CUDA: the producer and consumer types wrap it with the GPU side
//! (export, import, stream memory operations). Tests drive it across processes on machines
//! without a GPU.
//!
//! Layout: [`super::layout`] (offsets, sizes, states, wire codes) and docs/channel-layout.md (every
//! byte, the state machine of a buffer's `seq` word and hold masks, the pairing of every store with
//! its load under the `SYNC POINT` labels used here).

use super::SegmentFault;
use super::layout::{
    BufferSlot, CLOSED, ConsumerSlot, HEADER_SIZE, Header, MAGIC, MAX_BUFFERS, MAX_CONSUMERS,
    SEGMENT_PREFIX, STAMP_READY, VERSION, buffer_offset, consumer_offset, segment_len,
};
use crate::error::{Error, Result};
use crate::identity::ForkEpoch;
use crate::identity::{Liveness, ProcessIdentity};
use crate::shm::versioned::{
    self, Blocker, Creation, Creator, HeaderError, OpenError, StampWord, VersionedHeader,
};
use crate::shm::{Segment, SegmentOptions};
use crate::sync::{AtomicU32, AtomicU64, Ordering};
use crate::token::TOKEN_LEN;
use std::time::Duration;

/// How long an opener waits for the init stamp of a segment whose creator may still be writing it.
pub(super) const INIT_WAIT: Duration = Duration::from_secs(2);

/// The mapped control segment.
pub(crate) struct Control {
    pub(super) seg: Segment,
    pub(super) buffers: usize,
    pub(super) consumers: usize,
    /// This process's producer's reservation of a buffer whose holds it waits for (its index
    /// and the frame it held), while an acquire runs (`Control::acquire_keeping`), or from one
    /// slice of `Control::acquire_reserving` to the next; process-local. Set, completed and
    /// given back only in `reserve.rs`.
    pub(super) reserved: std::sync::Mutex<Option<(usize, u64)>>,
    /// What [`Control::close_withdrawing`] found, once it ran (process-local): the withdrawal is
    /// made once, by whichever thread closes first, and every later call gets the same frames.
    pub(super) withdrawn: std::sync::OnceLock<Vec<u64>>,
    /// Whether [`Control::close_withdrawing`] has begun (process-local), behind the lock that
    /// [`Control::publish`] holds while it checks this and publishes: a tensor set's `Closer`
    /// withdraws from another thread while the writer may be committing, and a publish either
    /// ends before the withdrawal (which then withdraws its frame too) or finds it begun and
    /// publishes nothing, so no hold is granted after the withdrawal.
    pub(super) withdrawing: std::sync::Mutex<bool>,
    /// The process (by fork) that mapped the segment: a forked child's copy acts on nothing
    /// ([`Control::inherited`]).
    pub(super) fork: ForkEpoch,
}

// SAFETY: all shared state is accessed through atomics or raw-pointer copies; the mapping itself is
// process-wide and stays valid while `seg` lives.
unsafe impl Send for Control {}
// SAFETY: as for Send: methods take `&self` and touch shared memory only through atomics.
unsafe impl Sync for Control {}

/// The segment name of a channel.
pub(crate) fn segment_name(channel: &str) -> String {
    segment_name_in(SEGMENT_PREFIX, channel)
}

/// The segment name of a control segment under `prefix` (a user channel's is
/// [`SEGMENT_PREFIX`]; a tensor set's generation channel has its own, `cuda-ipc.tg.`, so it is
/// no user channel). Every prefix has the length of [`SEGMENT_PREFIX`], so one name limit holds.
pub(crate) fn segment_name_in(prefix: &str, channel: &str) -> String {
    debug_assert_eq!(prefix.len(), SEGMENT_PREFIX.len());
    format!("{prefix}{channel}")
}

/// Longest channel name in bytes: the segment name `cuda-ipc.ch.NAME` must fit
/// [`crate::shm::MAX_SEGMENT_NAME`].
pub const MAX_CHANNEL_NAME: usize = crate::shm::MAX_SEGMENT_NAME - SEGMENT_PREFIX.len();

/// Checks a channel name: 1 to [`MAX_CHANNEL_NAME`] bytes of `[A-Za-z0-9._-]`.
pub(crate) fn validate_channel_name(channel: &str) -> Result<()> {
    validate_name_as(channel, "channel name")
}

/// [`validate_channel_name`] for a name that a channel bears on behalf of something else (a
/// tensor set's generation channel): the error calls it `what`.
pub(crate) fn validate_name_as(name: &str, what: &str) -> Result<()> {
    if name.len() > MAX_CHANNEL_NAME {
        return Err(Error::InvalidArgument(format!(
            "{what} {:?}... is {} bytes; at most {MAX_CHANNEL_NAME}",
            name.chars().take(32).collect::<String>(),
            name.len()
        )));
    }
    crate::shm::validate_name(name)
}

pub(super) fn boot_words(id: &ProcessIdentity) -> [u64; 2] {
    [
        u64::from_le_bytes(id.boot_id[..8].try_into().unwrap_or_default()),
        u64::from_le_bytes(id.boot_id[8..].try_into().unwrap_or_default()),
    ]
}

pub(super) fn boot_bytes(w: [u64; 2]) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&w[0].to_le_bytes());
    b[8..].copy_from_slice(&w[1].to_le_bytes());
    b
}

fn bad(fault: SegmentFault) -> Error {
    Error::Channel(super::ChannelError::BadSegment(fault))
}

// SAFETY: (1) the control `Header` is `#[repr(C)]` and all atomics (`super::layout`); (2) its
// alignment is 8; (3) it is `HEADER_SIZE` bytes (asserted in `super::layout`).
unsafe impl VersionedHeader for Header {
    const MAGIC: u64 = MAGIC;
    const VERSION: u32 = VERSION;
    const HEADER_LEN: usize = HEADER_SIZE;

    fn magic(&self) -> &AtomicU64 {
        &self.magic
    }
    fn version(&self) -> &AtomicU32 {
        &self.version
    }
    fn stamp(&self) -> StampWord<'_> {
        StampWord::U32(&self.stamp, STAMP_READY)
    }
    fn generation(&self) -> &AtomicU64 {
        &self.generation
    }
}

/// The producer's identity that header `h` records.
fn producer_of(h: &Header) -> ProcessIdentity {
    // SYNC POINT: producer recorded. Acquire, loaded first: pairs with the Release store of
    // `producer_pid` at creation (the identity is whole once the pid is seen).
    let pid = h.producer_pid.load(Ordering::Acquire);
    // Relaxed: written before the pid and the stamp, which an opener Acquire-loaded (or a judge's
    // diagnosis of a segment never stamped).
    ProcessIdentity {
        pid,
        start_time: h.producer_start_time.load(Ordering::Relaxed),
        boot_id: boot_bytes([
            h.producer_boot_id[0].load(Ordering::Relaxed),
            h.producer_boot_id[1].load(Ordering::Relaxed),
        ]),
        pid_ns: h.producer_pid_ns.load(Ordering::Relaxed),
    }
}

/// The creator that the control segment `seg` records, judged by the one rule of
/// [`Creator::judged`]: in use ([`used_since_stamped`]: its header overwritten), none recorded
/// yet (pid 0), dead, or running (or whose liveness cannot be told). For openers of a segment
/// that may lack its stamp ([`versioned::open_versioned_unless_abandoned`]) and its judges.
fn creator_of(seg: &Segment) -> Creator {
    let h = versioned::header::<Header>(seg);
    let p = producer_of(h);
    Creator::judged(
        p.pid != 0,
        || {
            // Relaxed: a diagnosis of a segment without its stamp (as `producer_of`).
            p.liveness_as(h.producer_uid.load(Ordering::Relaxed)) == Liveness::Dead
        },
        || used_since_stamped(seg),
    )
}

/// Whether the control segment `seg` (at least [`HEADER_SIZE`] bytes) shows use that only
/// follows its stamp: words its creator leaves zero (they are zero from `ftruncate`, and
/// `Control::create_in` writes none of them) and that only a producer or consumer of the stamped
/// segment writes: `head` (a frame published), `producer_state` (a close), `forced_releases`, a
/// buffer's `seq` (a claim: WRITING, or a frame), a consumer slot's `state` or `generation` (an
/// attach). The slots are read where the header's counts are in range and the mapping holds
/// them (a creation killed before its counts were written has none to read: its header words
/// decide).
fn used_since_stamped(seg: &Segment) -> bool {
    let h = versioned::header::<Header>(seg);
    // Relaxed (every load here): a look at single words; nothing is read through them.
    if h.head.load(Ordering::Relaxed) != 0
        || h.producer_state.load(Ordering::Relaxed) != 0
        || h.forced_releases.load(Ordering::Relaxed) != 0
    {
        return true;
    }
    let buffers = h.buffers.load(Ordering::Relaxed) as usize;
    let consumers = h.consumers.load(Ordering::Relaxed) as usize;
    if !(1..=MAX_BUFFERS).contains(&buffers)
        || !(1..=MAX_CONSUMERS).contains(&consumers)
        || seg.len() < segment_len(buffers, consumers)
    {
        return false;
    }
    let claimed = (0..buffers).any(|i| {
        // SAFETY: (1) slot `i < buffers` lies within the mapping (`segment_len` of the counts is
        // at most its length, checked above), which `seg` keeps alive; (2) its offset is a
        // multiple of 8 in a page-aligned mapping; (3) only its atomic `seq` word is read, so
        // other processes' concurrent writes are permitted; (4) any bit pattern is a valid
        // atomic integer.
        let slot = unsafe { &*seg.as_ptr().add(buffer_offset(i)).cast::<BufferSlot>() };
        slot.seq.load(Ordering::Relaxed) != 0
    });
    claimed
        || (0..consumers).any(|c| {
            // SAFETY: as for the buffer slots above, with `c < consumers`; only the atomic
            // `state` and `generation` words are read.
            let slot = unsafe {
                &*seg
                    .as_ptr()
                    .add(consumer_offset(buffers, c))
                    .cast::<ConsumerSlot>()
            };
            slot.state.load(Ordering::Relaxed) != 0 || slot.generation.load(Ordering::Relaxed) != 0
        })
}

/// What a control segment of name `name` is, in words: a user's `channel` (`cuda-ipc.ch.NAME`),
/// or, under another prefix, the `tensor set's generation channel` (`cuda-ipc.tg.NAME`, the one
/// other prefix: [`segment_name_in`]).
fn channel_kind(name: &str) -> &'static str {
    if name.starts_with(SEGMENT_PREFIX) {
        "channel"
    } else {
        "tensor set's generation channel"
    }
}

/// What an opener of the control segment `name` of `channel`, given `init_wait`, reports for
/// `e`: the segment's own errors unchanged (a missing one as [`super::ChannelError::NotFound`]),
/// the header's in the channel's words.
fn open_error(channel: &str, name: &str, init_wait: Duration, e: OpenError) -> Error {
    match e {
        OpenError::Segment(Error::Shm(crate::shm::ShmError::NotFound { .. })) => {
            Error::Channel(super::ChannelError::NotFound(channel.to_string()))
        }
        OpenError::Segment(e) => e,
        OpenError::Header(HeaderError::Foreign { magic }) => bad(SegmentFault::Foreign {
            segment: name.to_string(),
            what: channel_kind(name),
            magic,
        }),
        OpenError::Header(HeaderError::OtherVersion { found }) => {
            Error::Channel(super::ChannelError::VersionMismatch {
                channel: channel.to_string(),
                found,
                supported: VERSION,
            })
        }
        // No creation at all: a segment in use whose header was overwritten. Left as it is.
        OpenError::Header(HeaderError::InUse) => bad(SegmentFault::OverwrittenInUse {
            segment: name.to_string(),
            what: channel_kind(name),
        }),
        // Not waited for (or no longer): its creator died, or never recorded itself.
        OpenError::Header(HeaderError::Abandoned) => bad(SegmentFault::Abandoned {
            segment: name.to_string(),
        }),
        // Waited for in vain while the producer it records ran: overwritten, not in progress
        // (`versioned::StampWait`).
        OpenError::Header(HeaderError::Overwritten { waited }) => bad(SegmentFault::Overwritten {
            segment: name.to_string(),
            waited,
        }),
        // (No `BadStamp`: the control segment's stamp is not strict; a bad one is awaited.)
        OpenError::Header(_) => bad(SegmentFault::Unfinished {
            segment: name.to_string(),
            waited: init_wait,
        }),
    }
}

impl Control {
    /// Whether this process was forked from the one that mapped the segment
    /// (`identity::fork`): its consumer slot, holds, reservation and names are that process's,
    /// so neither a call nor a `Drop` in this process may act on them.
    pub(crate) fn inherited(&self) -> bool {
        self.fork.inherited()
    }

    /// `Ok` in the process that mapped the segment, else [`Error::ForkedChild`].
    pub(crate) fn check_fork(&self) -> Result<()> {
        self.fork.check("channel producer or consumer")
    }

    /// Creates the control segment of `channel` with `buffers` buffers of `buffer_bytes` bytes and
    /// room for `consumers` consumers; `tokens[i]` is the memory token of buffer `i`.
    /// A segment left by a dead producer is replaced; one of a live producer is an error.
    #[cfg(test)]
    pub(crate) fn create(
        channel: &str,
        buffer_bytes: u64,
        consumers: usize,
        tokens: &[[u8; TOKEN_LEN]],
        opts: &SegmentOptions,
    ) -> Result<Control> {
        Self::create_with_flags(channel, buffer_bytes, consumers, tokens, 0, opts)
    }

    /// `Control::create` (test builds only) with the header's `flags` ([`super::layout::FLAG_RING`]).
    pub(crate) fn create_with_flags(
        channel: &str,
        buffer_bytes: u64,
        consumers: usize,
        tokens: &[[u8; TOKEN_LEN]],
        flags: u32,
        opts: &SegmentOptions,
    ) -> Result<Control> {
        Self::create_in(
            SEGMENT_PREFIX,
            channel,
            buffer_bytes,
            consumers,
            tokens,
            flags,
            opts,
        )
    }

    /// [`Control::create_with_flags`] under the segment prefix `prefix` ([`segment_name_in`]).
    pub(crate) fn create_in(
        prefix: &'static str,
        channel: &str,
        buffer_bytes: u64,
        consumers: usize,
        tokens: &[[u8; TOKEN_LEN]],
        flags: u32,
        opts: &SegmentOptions,
    ) -> Result<Control> {
        validate_channel_name(channel)?;
        let buffers = tokens.len();
        if buffers == 0 || buffers > MAX_BUFFERS {
            return Err(Error::InvalidArgument(format!(
                "a pool needs 1 to {MAX_BUFFERS} buffers, got {buffers}"
            )));
        }
        if consumers == 0 || consumers > MAX_CONSUMERS {
            return Err(Error::InvalidArgument(format!(
                "a channel takes 1 to {MAX_CONSUMERS} consumers, got {consumers}"
            )));
        }
        let name = segment_name_in(prefix, channel);
        let len = segment_len(buffers, consumers);
        // A stale segment from a crashed producer must not block a restart; anything else under
        // the name is left alone and named in the error. Two producers restarting at once: each
        // removes only the segment it judged, under `unlink_if_same`'s lock, so the slower one
        // finds the faster one's new segment, alive, and gets `AlreadyExists`.
        // Before the segment is made: the first call of a process creates its liveness file, whose
        // failure (a full /dev/shm) must not leave the new segment behind.
        let me = ProcessIdentity::current()?;
        let seg = versioned::create_replacing(&name, len, opts, "channel segment", || {
            match Self::replaceable(channel, &name) {
                Ok(why) => Ok(Some(why)),
                // Another replacer removed it meanwhile: create again.
                Err(Error::Channel(super::ChannelError::NotFound(_)))
                | Err(Error::Shm(crate::shm::ShmError::NotFound { .. })) => Ok(None),
                Err(e) => Err(e),
            }
        })?;
        let c = Control {
            seg,
            buffers,
            consumers,
            reserved: Default::default(),
            withdrawn: Default::default(),
            withdrawing: Default::default(),
            fork: ForkEpoch::now(),
        };
        // SYNC POINT: stamp. Release, stored last by `write_versioned`: pairs with the Acquire load
        // of `stamp` in `open` (`open_versioned`); everything written here is visible to an opener
        // that sees READY.
        versioned::write_versioned::<Header>(
            &c.seg,
            |h| {
                h.producer_start_time
                    .store(me.start_time, Ordering::Relaxed);
                let bw = boot_words(&me);
                h.producer_boot_id[0].store(bw[0], Ordering::Relaxed);
                h.producer_boot_id[1].store(bw[1], Ordering::Relaxed);
                h.producer_pid_ns.store(me.pid_ns, Ordering::Relaxed);
                h.producer_uid
                    .store(rustix::process::geteuid().as_raw(), Ordering::Relaxed);
                // SYNC POINT: producer recorded. Release, stored last: pairs with the Acquire
                // load of `producer_pid` in `producer_of`; a judge of the segment before its
                // stamp that sees the pid sees the whole identity (a torn one reads as dead).
                h.producer_pid.store(me.pid, Ordering::Release);
            },
            |h| {
                h.buffers.store(buffers as u32, Ordering::Relaxed);
                h.consumers.store(consumers as u32, Ordering::Relaxed);
                h.buffer_bytes.store(buffer_bytes, Ordering::Relaxed);
                h.segment_bytes.store(len as u64, Ordering::Relaxed);
                h.flags.store(flags, Ordering::Relaxed);
                for (i, mem) in tokens.iter().enumerate() {
                    let p = c.buffer_ptr(i);
                    // SAFETY: `p` points to buffer slot `i` inside the mapping (i < buffers); the
                    // token area is written only here, before the stamp, by the creator alone.
                    unsafe {
                        let dst = std::ptr::addr_of_mut!((*p).tokens).cast::<u8>();
                        std::ptr::copy_nonoverlapping(mem.as_ptr(), dst, TOKEN_LEN);
                    }
                }
            },
        );
        Ok(c)
    }

    /// Decides whether the segment `name` that blocks creating `channel` may be replaced, and
    /// says why; otherwise the typed error that names what is there. Only this user's own
    /// segments are ever replaced, and of those only: a channel of this layout version whose
    /// producer is dead, or a creation abandoned half-way (empty, sparse or never stamped, and at
    /// least 2 s old, with no live creator recorded). Another user's segment, a live producer's
    /// segment of any version, a foreign file, a FIFO or a directory are never touched.
    ///
    /// # Errors
    /// [`super::ChannelError::AlreadyExists`] for a live producer's channel;
    /// [`super::ChannelError::CreationInProgress`] for an empty or sparse segment being sized, and
    /// for one without its stamp whose recorded producer runs but did not record itself 500 ms
    /// before the 2 s wait ended; [`SegmentFault::Overwritten`] (in
    /// [`super::ChannelError::BadSegment`]) for one whose stamp is still 0 after the wait though
    /// its producer runs and had recorded itself by then (a header overwritten, never replaced);
    /// [`SegmentFault::OverwrittenInUse`] for one without its stamp that shows use which only
    /// follows the stamp (a segment in use whose header was overwritten, whatever producer it
    /// records: never replaced); the errors of [`Control::open_in`] and
    /// [`versioned::stat_blocker`] otherwise.
    pub(crate) fn replaceable(channel: &str, name: &str) -> Result<&'static str> {
        match versioned::stat_blocker(name, HEADER_SIZE)? {
            Blocker::Abandoned => return Ok(versioned::ABANDONED_UNSIZED),
            Blocker::Young => {
                return Err(Error::Channel(super::ChannelError::CreationInProgress(
                    channel.to_string(),
                )));
            }
            Blocker::Sized(_) => {}
        }
        // A stamp is waited for only while a producer may still write it (one recorded that
        // runs, or none recorded yet in a young segment): an abandoned creation costs no wait.
        match versioned::open_versioned_unless_abandoned::<Header>(
            name, false, INIT_WAIT, creator_of,
        ) {
            Ok(seg) => {
                let old = Self::checked(seg, name)?;
                let p = old.producer();
                if old.producer_liveness() == Liveness::Dead {
                    Ok("its producer is dead")
                } else {
                    Err(Error::Channel(super::ChannelError::AlreadyExists {
                        channel: channel.to_string(),
                        pid: p.pid,
                    }))
                }
            }
            Err(OpenError::Header(HeaderError::Unstamped { .. } | HeaderError::Abandoned)) => {
                // Our magic (or none yet) but no init stamp after the open's wait: a creator died
                // half-way, unless one is recorded and still runs.
                let seg = Segment::open_with_min_len(name, HEADER_SIZE)?;
                let c = Control {
                    seg,
                    buffers: 0,
                    consumers: 0,
                    reserved: Default::default(),
                    withdrawn: Default::default(),
                    withdrawing: Default::default(),
                    fork: ForkEpoch::now(),
                };
                match creator_of(&c.seg) {
                    Creator::Running => Err(Error::Channel(
                        super::ChannelError::CreationInProgress(channel.to_string()),
                    )),
                    // Shows use that only follows the stamp: never a creation; kept.
                    Creator::InUse => Err(open_error(
                        channel,
                        name,
                        INIT_WAIT,
                        OpenError::Header(HeaderError::InUse),
                    )),
                    Creator::Dead | Creator::Unrecorded => {
                        Ok("a creation abandoned before it was finished")
                    }
                }
            }
            Err(e) => Err(open_error(channel, name, INIT_WAIT, e)),
        }
    }

    /// Judges, without waiting, the segment `name` of `channel` that an opener could not use, by
    /// the rule of [`Control::replaceable`]: empty or sparse, abandoned once 2 s old with its
    /// sizing lock free, else under way; sized and never stamped, under way while its producer
    /// may still stamp it ([`versioned::may_still_stamp`]: one recorded that runs, or none
    /// recorded in a segment younger than 2 s), else abandoned; stamped, [`Creation::Finished`].
    /// Maps and loads its header words; changes nothing.
    ///
    /// # Errors
    /// What is under the name when it is no creation of ours: [`crate::shm::ShmError::NotFound`]
    /// when there is nothing, [`crate::shm::ShmError::WrongOwner`] for another user's segment,
    /// [`crate::shm::ShmError::InsecureMode`] for one open to other users (any of the mode bits
    /// `0o007`), [`crate::shm::ShmError::NotASegment`] for a FIFO, directory, socket or device,
    /// [`crate::shm::ShmError::TooSmall`] for a short file whose pages are there,
    /// [`SegmentFault::Foreign`] and [`super::ChannelError::VersionMismatch`] for another magic or
    /// layout version, [`SegmentFault::OverwrittenInUse`] for one without its stamp that shows
    /// use which only follows the stamp (never a creation: kept).
    pub(crate) fn judge_creation(channel: &str, name: &str) -> Result<Creation> {
        match versioned::stat_blocker(name, HEADER_SIZE)? {
            Blocker::Abandoned => return Ok(Creation::Abandoned(versioned::ABANDONED_UNSIZED)),
            Blocker::Young => {
                return Ok(Creation::UnderWay(versioned::UNDER_WAY_UNSIZED.to_string()));
            }
            Blocker::Sized(_) => {}
        }
        match versioned::open_versioned::<Header>(name, false, Duration::ZERO) {
            Ok(_) => Ok(Creation::Finished),
            Err(OpenError::Header(HeaderError::Unstamped { .. })) => {
                let seg = Segment::open_with_min_len(name, HEADER_SIZE)?;
                let creator = creator_of(&seg);
                if creator == Creator::InUse {
                    return Err(open_error(
                        channel,
                        name,
                        Duration::ZERO,
                        OpenError::Header(HeaderError::InUse),
                    ));
                }
                if !versioned::may_still_stamp(name, creator) {
                    return Ok(Creation::Abandoned(
                        "a creation abandoned before it was finished",
                    ));
                }
                if creator == Creator::Unrecorded {
                    return Ok(Creation::UnderWay(
                        versioned::UNDER_WAY_UNSTAMPED.to_string(),
                    ));
                }
                let h = versioned::header::<Header>(&seg);
                let p = producer_of(h);
                // Relaxed: a diagnosis of a segment without its stamp (as `producer_of`).
                Ok(Creation::UnderWay(
                    if p.liveness_as(h.producer_uid.load(Ordering::Relaxed)) == Liveness::Alive {
                        format!("a creation under way: not stamped yet, by {p}, which runs")
                    } else {
                        format!(
                            "a creation not stamped yet, by {p}, whose liveness cannot be told \
                             from here"
                        )
                    },
                ))
            }
            Err(e) => Err(open_error(channel, name, Duration::ZERO, e)),
        }
    }

    /// Opens and validates the control segment of `channel`.
    pub(crate) fn open(channel: &str) -> Result<Control> {
        Self::open_with(channel, false)
    }

    /// Opens the control segment of `channel`; with `allow_group`, also one of another user of
    /// this process's groups whose mode is 0660 (the producer's `group_access`).
    pub(crate) fn open_with(channel: &str, allow_group: bool) -> Result<Control> {
        Self::open_waiting(channel, allow_group, INIT_WAIT)
    }

    /// [`Control::open_with`], waiting at most `init_wait` (instead of [`INIT_WAIT`]) for the
    /// stamp of a segment whose creator may still be writing it (tests and fuzzing).
    pub(crate) fn open_waiting(
        channel: &str,
        allow_group: bool,
        init_wait: Duration,
    ) -> Result<Control> {
        Self::open_in(SEGMENT_PREFIX, channel, allow_group, init_wait)
    }

    /// [`Control::open_waiting`] under the segment prefix `prefix` ([`segment_name_in`]).
    ///
    /// # Errors
    /// [`super::ChannelError::NotFound`]; the segment's own errors ([`crate::Error::Shm`]: another
    /// user's, not a file, sparse, too small); [`super::ChannelError::VersionMismatch`];
    /// [`super::ChannelError::BadSegment`] with [`SegmentFault::Foreign`] for another magic,
    /// [`SegmentFault::Abandoned`] for a creation abandoned half-way (told at once),
    /// [`SegmentFault::Overwritten`] for a stamp still 0 after `init_wait` though the producer
    /// recorded runs and had recorded itself at least 500 ms before the wait ended (a header
    /// overwritten, not a creation in progress: `versioned::STAMP_DUE`),
    /// [`SegmentFault::Unfinished`] for any other stamp not there after `init_wait`, and the
    /// layout's own checks (counts, size).
    pub(crate) fn open_in(
        prefix: &str,
        channel: &str,
        allow_group: bool,
        init_wait: Duration,
    ) -> Result<Control> {
        validate_channel_name(channel)?;
        let name = segment_name_in(prefix, channel);
        // A creator may still be writing: its stamp is waited for (bounded), but only while it
        // may still come (one recorded that runs, or none recorded yet in a segment younger than
        // 2 s): a creation abandoned half-way is refused at once, never waited for.
        // SYNC POINT: stamp. Acquire, in `open_versioned`'s look: pairs with the Release store of
        // the stamp in `create`; the fields read in `checked` are the creator's.
        let seg = versioned::open_versioned_unless_abandoned::<Header>(
            &name,
            allow_group,
            init_wait,
            creator_of,
        )
        .map_err(|e| open_error(channel, &name, init_wait, e))?;
        Self::checked(seg, &name)
    }

    /// [`Control::open_in`] for tools (`inspect`, `gc`'s judgements and removals): this user's
    /// segment only, and its stamp waited for (up to [`INIT_WAIT`]) only while a creator may still
    /// write it, as every opener does ([`versioned::open_versioned_unless_abandoned`]).
    ///
    /// # Errors
    /// As [`Control::open_in`]; [`SegmentFault::Abandoned`] (in
    /// [`super::ChannelError::BadSegment`]) for a creation abandoned half-way.
    pub(crate) fn open_unless_abandoned_in(prefix: &str, channel: &str) -> Result<Control> {
        Self::open_in(prefix, channel, false, INIT_WAIT)
    }

    /// The layout's own checks of a stamped segment of this magic and version: the counts and
    /// the size its header claims.
    fn checked(seg: Segment, name: &str) -> Result<Control> {
        let h = versioned::header::<Header>(&seg);
        let buffers = h.buffers.load(Ordering::Relaxed) as usize;
        let consumers = h.consumers.load(Ordering::Relaxed) as usize;
        if !(1..=MAX_BUFFERS).contains(&buffers) || !(1..=MAX_CONSUMERS).contains(&consumers) {
            return Err(bad(SegmentFault::Counts {
                segment: name.to_string(),
                buffers,
                consumers,
            }));
        }
        let need = segment_len(buffers, consumers);
        if seg.len() < need {
            return Err(bad(SegmentFault::Truncated {
                segment: name.to_string(),
                len: seg.len(),
                need,
            }));
        }
        let recorded = h.segment_bytes.load(Ordering::Relaxed);
        if recorded != need as u64 {
            return Err(bad(SegmentFault::SizeWord {
                segment: name.to_string(),
                recorded,
                buffers,
                consumers,
                need,
                len: seg.len(),
            }));
        }
        Ok(Control {
            seg,
            buffers,
            consumers,
            reserved: Default::default(),
            withdrawn: Default::default(),
            withdrawing: Default::default(),
            fork: ForkEpoch::now(),
        })
    }

    pub(super) fn header(&self) -> &Header {
        // SAFETY: the mapping holds at least a Header (checked at create/open), is page aligned,
        // and Header is only atomics, so a shared reference to it is sound even though other
        // processes write it.
        unsafe { &*self.seg.as_ptr().cast::<Header>() }
    }

    pub(super) fn buffer_ptr(&self, i: usize) -> *mut BufferSlot {
        debug_assert!(i < self.buffers.max(1));
        // SAFETY: the offset stays inside the mapping: i < buffers and the length was checked.
        unsafe { self.seg.as_ptr().add(buffer_offset(i)).cast() }
    }

    pub(super) fn buffer(&self, i: usize) -> &BufferSlot {
        // SAFETY: in bounds (see buffer_ptr), 8-byte aligned (sizes are multiples of 8 after a
        // page-aligned base); only the atomic fields are read through this reference, the token
        // bytes through raw-pointer copies.
        unsafe { &*self.buffer_ptr(i) }
    }

    pub(super) fn consumer_ptr(&self, c: usize) -> *mut ConsumerSlot {
        // SAFETY: in bounds: c < consumers and the length was checked.
        unsafe {
            self.seg
                .as_ptr()
                .add(consumer_offset(self.buffers, c))
                .cast()
        }
    }

    pub(super) fn consumer(&self, c: usize) -> &ConsumerSlot {
        // SAFETY: as for `buffer`.
        unsafe { &*self.consumer_ptr(c) }
    }

    pub(crate) fn buffers(&self) -> usize {
        self.buffers
    }

    pub(crate) fn consumer_capacity(&self) -> usize {
        self.consumers
    }

    pub(crate) fn buffer_bytes(&self) -> u64 {
        self.header().buffer_bytes.load(Ordering::Relaxed)
    }

    /// The memory token of buffer `i`.
    pub(crate) fn buffer_token(&self, i: usize) -> [u8; TOKEN_LEN] {
        let mut mem = [0u8; TOKEN_LEN];
        let p = self.buffer_ptr(i);
        // SAFETY: the token area of slot i is inside the mapping and immutable after the stamp
        // (read after `open` Acquire-loaded it); copied out byte-wise, never referenced.
        unsafe {
            let src = std::ptr::addr_of!((*p).tokens).cast::<u8>();
            std::ptr::copy_nonoverlapping(src, mem.as_mut_ptr(), TOKEN_LEN);
        }
        mem
    }

    /// Whether the channel hands buffers out in ring order ([`super::layout::FLAG_RING`]).
    pub(crate) fn is_ring(&self) -> bool {
        // Relaxed: written once before the stamp, which the opener Acquire-loaded.
        self.header().flags.load(Ordering::Relaxed) & super::layout::FLAG_RING != 0
    }

    /// The producer's identity as recorded.
    pub(crate) fn producer(&self) -> ProcessIdentity {
        producer_of(self.header())
    }

    /// The producer's effective uid, recorded beside its identity.
    pub(crate) fn producer_uid(&self) -> u32 {
        // Relaxed: written with the identity before the stamp, which the opener Acquire-loaded.
        self.header().producer_uid.load(Ordering::Relaxed)
    }

    /// Whether the producer runs: its identity with its recorded uid
    /// ([`ProcessIdentity::liveness_as`]).
    pub(crate) fn producer_liveness(&self) -> Liveness {
        self.producer().liveness_as(self.producer_uid())
    }

    pub(crate) fn head(&self) -> u64 {
        // SYNC POINT: head. Acquire: pairs with the Release store in `publish`; a reader that sees
        // head = s sees the buffer slot's seq and metadata of frame s.
        self.header().head.load(Ordering::Acquire)
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.producer_state() == CLOSED
    }

    /// The header's `producer_state` code (see [`super::layout::ProducerState`]).
    pub(crate) fn producer_state(&self) -> u32 {
        // SYNC POINT: closed. Acquire: pairs with the Release store in `close`.
        self.header().producer_state.load(Ordering::Acquire)
    }

    /// [`super::ChannelError::Superseded`] when the channel's name now stands for another segment
    /// (removed and made again): one `stat`, on the slow path of a wait only.
    pub(crate) fn check_superseded(&self) -> Result<()> {
        if self.seg.name_is_still_this() {
            return Ok(());
        }
        let name = self.seg.name();
        Err(Error::Channel(super::ChannelError::Superseded(
            // Every prefix has the length of SEGMENT_PREFIX (`segment_name_in`).
            name.get(SEGMENT_PREFIX.len()..).unwrap_or(name).to_string(),
        )))
    }

    /// The creation generation written in the header (random, nonzero).
    pub(crate) fn generation(&self) -> u64 {
        // Relaxed: written once before the stamp, which the opener Acquire-loaded.
        self.header().generation.load(Ordering::Relaxed)
    }

    /// Unlinks the segment name while it still stands for this segment (never one that replaced
    /// it); the mapping stays valid for processes that have it open.
    pub(crate) fn unlink(&self) {
        let r = self
            .seg
            .inode()
            .and_then(|ino| Segment::unlink_if_same(self.seg.name(), ino));
        if let Err(e) = r {
            tracing::warn!("unlinking {}: {e}", self.seg.name());
        }
    }

    // ---------------------------------------------------------------- inspection (loads only)

    /// The mapped segment (name, size, inode), for inspection tools.
    pub(crate) fn segment(&self) -> &Segment {
        &self.seg
    }

    /// Buffer slot `i`, for inspection tools (`channel::inspect`, loads only).
    pub(crate) fn buffer_slot(&self, i: usize) -> &BufferSlot {
        assert!(i < self.buffers);
        self.buffer(i)
    }

    /// The header, for tests that write fields directly.
    #[cfg(test)]
    pub(crate) fn header_for_tests(&self) -> &Header {
        self.header()
    }

    /// Consumer slot `c`, for inspection tools (`channel::inspect`, loads only).
    pub(crate) fn consumer_slot(&self, c: usize) -> &ConsumerSlot {
        assert!(c < self.consumers);
        self.consumer(c)
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::channel::{Delivery, WaitStrategy};
    use crate::token::{Token, TokenKind};
    use std::sync::atomic::AtomicU32 as StdAtomicU32;
    use std::time::Instant;

    fn fake_token(i: u8) -> [u8; TOKEN_LEN] {
        Token {
            kind: TokenKind::LegacyMemory,
            handle: [i; 64],
            offset: 0,
            len: 64,
            device: crate::driver::Uuid([1; 16]),
            exporter: ProcessIdentity::current().unwrap(),
            export_id: 0,
        }
        .to_bytes()
    }

    pub(in crate::channel) fn channel(buffers: usize) -> (Control, String) {
        static N: StdAtomicU32 = StdAtomicU32::new(0);
        let name = format!(
            "test-{}-{}",
            std::process::id(),
            N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let tokens: Vec<_> = (0..buffers as u8).map(fake_token).collect();
        let c = Control::create(&name, 64, 4, &tokens, &SegmentOptions::new()).unwrap();
        (c, name)
    }

    #[test]
    fn channel_names_are_checked_against_the_channel_limit() {
        let long = "c".repeat(MAX_CHANNEL_NAME + 1);
        let e = Control::open(&long).map(|_| ()).unwrap_err().to_string();
        assert!(e.contains(&format!("at most {MAX_CHANNEL_NAME}")), "{e}");
        assert!(!e.contains("cuda-ipc.ch."), "{e}");
        let e = Control::create(&long, 64, 1, &[[0; TOKEN_LEN]], &SegmentOptions::new())
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(e.contains(&format!("at most {MAX_CHANNEL_NAME}")), "{e}");
        assert!(Control::open("a/b").is_err());
        assert!(Control::open("").is_err());
    }

    #[test]
    fn dead_producer_is_reported_and_a_restart_replaces_its_segment() {
        let (p, name) = channel(1);
        let c = Control::open(&name).unwrap();
        let me = c.attach(Delivery::EveryFrame).unwrap();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        p.header().producer_pid.store(pid, Ordering::Relaxed);
        let t = Instant::now();
        let r = c.take(
            me,
            WaitStrategy::Block,
            Some(Duration::from_secs(5)),
            &Default::default(),
        );
        assert!(
            matches!(
                r,
                Err(Error::Channel(super::super::ChannelError::ProducerGone { pid: x })) if x == pid
            ),
            "{:?}",
            r.map(|_| ())
        );
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "took {:?}",
            t.elapsed()
        );
        // A new producer replaces the dead one's segment.
        let tokens = [fake_token(1)];
        let p2 = Control::create(&name, 64, 4, &tokens, &SegmentOptions::new()).unwrap();
        // A live producer's segment is not replaced.
        let e = Control::create(&name, 64, 4, &tokens, &SegmentOptions::new());
        assert!(matches!(
            e,
            Err(Error::Channel(
                super::super::ChannelError::AlreadyExists { .. }
            ))
        ));
        p2.unlink();
    }

    #[test]
    fn foreign_truncated_and_newer_segments_are_refused() {
        let (p, name) = channel(1);
        p.header().version.store(VERSION + 1, Ordering::Relaxed);
        let e = Control::open(&name).map(|_| ()).unwrap_err().to_string();
        assert!(
            e.contains(&format!("version {}", VERSION + 1))
                && e.contains(&format!("reads version {VERSION}")),
            "{e}"
        );
        p.header().version.store(VERSION, Ordering::Relaxed);
        p.header().magic.store(7, Ordering::Relaxed);
        assert!(
            Control::open(&name)
                .map(|_| ())
                .unwrap_err()
                .to_string()
                .contains("not a cuda-ipc channel")
        );
        p.header().magic.store(MAGIC, Ordering::Relaxed);
        p.header().buffers.store(999, Ordering::Relaxed);
        assert!(
            Control::open(&name)
                .map(|_| ())
                .unwrap_err()
                .to_string()
                .contains("corrupted")
        );
        p.header().buffers.store(1, Ordering::Relaxed);
        p.header().segment_bytes.store(1 << 40, Ordering::Relaxed);
        let e = Control::open(&name).map(|_| ()).unwrap_err().to_string();
        assert!(
            e.contains(&format!("records a size of {} bytes", 1u64 << 40))
                && e.contains(&format!("need {}", segment_len(1, 4)))
                && e.contains("corrupted"),
            "{e}"
        );
        p.unlink();
        assert!(matches!(
            Control::open(&name),
            Err(Error::Channel(super::super::ChannelError::NotFound(_)))
        ));
    }
}
