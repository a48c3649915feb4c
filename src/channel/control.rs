//! The channel's control block: a POSIX shared-memory segment holding the pool's tokens, each
//! buffer's state and holders, each consumer's cursor and release events, and two futex words.
//!
//! This is the whole protocol, and it never calls CUDA: the producer and consumer types wrap it with
//! the GPU side (export, import, events). Tests drive it across processes on machines without a GPU.
//!
//! Layout: [`super::layout`] (offsets, sizes, states, wire codes) and docs/channel-layout.md (every
//! byte, the state machine of a buffer's `seq` word and hold masks, the pairing of every store with
//! its load under the `SYNC POINT` labels used here).
//!
//! Holding a buffer is a Dekker pair ([`HoldWords`]): the consumer sets its bit in `hold_mask` and
//! then re-reads `seq`; the producer swaps `seq` to [`WRITING`] and then re-reads `hold_mask`. Both
//! sides use `SeqCst` accesses with a `SeqCst` fence between the two, so at least one of them sees
//! the other and backs off: a buffer is never written while a consumer holds it (loom model
//! `loom_channel_*` below).

use super::layout::{
    ACTIVE, BufferSlot, CLAIMING, CLOSED, ConsumerSlot, Delivery, EVERY_FRAME, FREE, HEADER_SIZE,
    Header, LATEST_ONLY, MAGIC, MAX_BUFFERS, MAX_CONSUMERS, META_BYTES, META_WORDS, READY_PAGE,
    SEGMENT_PREFIX, SEQ_EMPTY, STAMP_READY, VERSION, WRITING, buffer_offset, consumer_offset,
    ready_offset, ready_word_offset, segment_len,
};
use crate::error::{Error, Result};
use crate::identity::{Liveness, ProcessIdentity};
use crate::shm::versioned::{self, Blocker, HeaderError, OpenError, StampWord, VersionedHeader};
use crate::shm::{Segment, SegmentOptions, futex};
use crate::sync::{AtomicU32, AtomicU64, Ordering, fence};
use crate::token::TOKEN_LEN;
use std::time::{Duration, Instant};

/// How a thread waits for a condition on a futex word.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum WaitStrategy {
    /// Sleep on the futex at once (lowest CPU use; wake-up ≈ 10–20 µs).
    Block,
    /// Spin for the given time, then sleep on the futex (the default: 50 µs).
    SpinThenBlock(Duration),
    /// Spin until the timeout (lowest latency, one core busy; wake-up well under 1 µs).
    Spin,
}

impl Default for WaitStrategy {
    fn default() -> Self {
        WaitStrategy::SpinThenBlock(Duration::from_micros(50))
    }
}

/// How long an opener waits for the init stamp of a segment whose creator may still be writing it.
const INIT_WAIT: Duration = Duration::from_secs(2);

/// Liveness is re-checked at least this often while waiting.
const LIVENESS_EVERY: Duration = Duration::from_millis(20);
/// How often a waiting producer or consumer looks whether its channel's name was superseded: a
/// `Superseded` error comes within this (plus one liveness period) of the change.
const SUPERSEDED_EVERY: Duration = Duration::from_millis(500);

/// A timer for checks that run on a slower cadence than the liveness check.
struct Every {
    period: Duration,
    next: Instant,
}

impl Every {
    fn new(period: Duration) -> Every {
        Every {
            period,
            next: Instant::now() + period,
        }
    }
    /// `true` at most once per period.
    fn due(&mut self) -> bool {
        let now = Instant::now();
        if now >= self.next {
            self.next = now + self.period;
            true
        } else {
            false
        }
    }
}

/// Counters of one consumer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConsumerStats {
    /// Consumer slot index.
    pub index: usize,
    /// Its process.
    pub pid: u32,
    /// Frames received.
    pub received: u64,
    /// Frames skipped (latest-only delivery, or published before it could take them).
    pub dropped: u64,
    /// Frames it holds now.
    pub in_flight: u32,
    /// Frames published that it has not received or skipped: `head - cursor`.
    pub lag: u64,
}

/// Counters of a channel.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ChannelStats {
    /// Frames published.
    pub published: u64,
    /// Sequence number of the latest frame.
    pub head: u64,
    /// Holds released by the producer on behalf of dead consumers or at shutdown.
    pub forced_releases: u64,
    /// One entry per attached consumer.
    pub consumers: Vec<ConsumerStats>,
}

/// The mapped control segment.
pub(crate) struct Control {
    seg: Segment,
    buffers: usize,
    consumers: usize,
}

// SAFETY: all shared state is accessed through atomics or raw-pointer copies; the mapping itself is
// process-wide and stays valid while `seg` lives.
unsafe impl Send for Control {}
// SAFETY: as for Send: methods take `&self` and touch shared memory only through atomics.
unsafe impl Sync for Control {}

/// The segment name of a channel.
pub(crate) fn segment_name(channel: &str) -> String {
    format!("{SEGMENT_PREFIX}{channel}")
}

/// Longest channel name in bytes: the segment name `cuda-ipc.ch.NAME` must fit
/// [`crate::shm::MAX_SEGMENT_NAME`].
pub const MAX_CHANNEL_NAME: usize = crate::shm::MAX_SEGMENT_NAME - SEGMENT_PREFIX.len();

/// Checks a channel name: 1 to [`MAX_CHANNEL_NAME`] bytes of `[A-Za-z0-9._-]`.
pub(crate) fn validate_channel_name(channel: &str) -> Result<()> {
    if channel.len() > MAX_CHANNEL_NAME {
        return Err(Error::InvalidArgument(format!(
            "channel name {:?}... is {} bytes; at most {MAX_CHANNEL_NAME}",
            channel.chars().take(32).collect::<String>(),
            channel.len()
        )));
    }
    crate::shm::validate_name(channel)
}

fn boot_words(id: &ProcessIdentity) -> [u64; 2] {
    [
        u64::from_le_bytes(id.boot_id[..8].try_into().unwrap_or_default()),
        u64::from_le_bytes(id.boot_id[8..].try_into().unwrap_or_default()),
    ]
}

fn boot_bytes(w: [u64; 2]) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&w[0].to_le_bytes());
    b[8..].copy_from_slice(&w[1].to_le_bytes());
    b
}

fn bad(msg: String) -> Error {
    Error::Channel(super::ChannelError::BadSegment(msg))
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

/// What an opener of the control segment `name` of `channel`, given `init_wait`, reports for
/// `e`: the segment's own errors unchanged (a missing one as [`super::ChannelError::NotFound`]),
/// the header's in the channel's words.
fn open_error(channel: &str, name: &str, init_wait: Duration, e: OpenError) -> Error {
    match e {
        OpenError::Segment(Error::Shm(crate::shm::ShmError::NotFound { .. })) => {
            Error::Channel(super::ChannelError::NotFound(channel.to_string()))
        }
        OpenError::Segment(e) => e,
        OpenError::Header(HeaderError::Foreign { magic }) => bad(format!(
            "{name} is not a cuda-ipc channel (magic {magic:#018x})"
        )),
        OpenError::Header(HeaderError::OtherVersion { found }) => {
            Error::Channel(super::ChannelError::VersionMismatch {
                channel: channel.to_string(),
                found,
                supported: VERSION,
            })
        }
        // (No `BadStamp`: the control segment's stamp is not strict; a bad one is awaited.)
        OpenError::Header(_) => {
            let waited = if init_wait.subsec_nanos() == 0 {
                format!("{} s", init_wait.as_secs())
            } else {
                format!("{} ms", init_wait.as_millis())
            };
            bad(format!(
                "{name} was never finished by its creator (no init stamp after {waited})"
            ))
        }
    }
}

impl Control {
    /// Creates the control segment of `channel` with `buffers` buffers of `buffer_bytes` bytes and
    /// room for `consumers` consumers; `tokens[i]` = (memory token, event token) of buffer `i`.
    /// A segment left by a dead producer is replaced; one of a live producer is an error.
    pub(crate) fn create(
        channel: &str,
        buffer_bytes: u64,
        consumers: usize,
        tokens: &[([u8; TOKEN_LEN], [u8; TOKEN_LEN])],
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
        let name = segment_name(channel);
        let len = segment_len(buffers, consumers);
        // A stale segment from a crashed producer must not block a restart; anything else under
        // the name is left alone and named in the error. Two producers restarting at once: each
        // removes only the segment it judged, under `unlink_if_same`'s lock, so the slower one
        // finds the faster one's new segment, alive, and gets `AlreadyExists`.
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
        };
        let me = ProcessIdentity::current()?;
        // SYNC POINT: stamp. Release, stored last by `write_versioned`: pairs with the Acquire load
        // of `stamp` in `open` (`open_versioned`); everything written here is visible to an opener
        // that sees READY.
        versioned::write_versioned::<Header>(
            &c.seg,
            |h| {
                h.producer_pid.store(me.pid, Ordering::Relaxed);
                h.producer_start_time
                    .store(me.start_time, Ordering::Relaxed);
                let bw = boot_words(&me);
                h.producer_boot_id[0].store(bw[0], Ordering::Relaxed);
                h.producer_boot_id[1].store(bw[1], Ordering::Relaxed);
                h.producer_pid_ns.store(me.pid_ns, Ordering::Relaxed);
            },
            |h| {
                h.buffers.store(buffers as u32, Ordering::Relaxed);
                h.consumers.store(consumers as u32, Ordering::Relaxed);
                h.buffer_bytes.store(buffer_bytes, Ordering::Relaxed);
                h.segment_bytes.store(len as u64, Ordering::Relaxed);
                for (i, (mem, ev)) in tokens.iter().enumerate() {
                    let p = c.buffer_ptr(i);
                    // SAFETY: `p` points to buffer slot `i` inside the mapping (i < buffers); the
                    // token area is written only here, before the stamp, by the creator alone.
                    unsafe {
                        let dst = std::ptr::addr_of_mut!((*p).tokens).cast::<u8>();
                        std::ptr::copy_nonoverlapping(mem.as_ptr(), dst, TOKEN_LEN);
                        std::ptr::copy_nonoverlapping(ev.as_ptr(), dst.add(TOKEN_LEN), TOKEN_LEN);
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
        match versioned::open_versioned::<Header>(name, false, INIT_WAIT) {
            Ok(seg) => {
                let old = Self::checked(seg, name)?;
                let p = old.producer();
                if p.liveness() == Liveness::Dead {
                    Ok("its producer is dead")
                } else {
                    Err(Error::Channel(super::ChannelError::AlreadyExists {
                        channel: channel.to_string(),
                        pid: p.pid,
                    }))
                }
            }
            Err(OpenError::Header(HeaderError::Unstamped { .. })) => {
                // Our magic (or none yet) but no init stamp after the open's wait: a creator died
                // half-way, unless one is recorded and still runs.
                let seg = Segment::open_with_min_len(name, HEADER_SIZE)?;
                let c = Control {
                    seg,
                    buffers: 0,
                    consumers: 0,
                };
                let p = c.producer();
                if p.pid != 0 && p.liveness() != Liveness::Dead {
                    return Err(Error::Channel(super::ChannelError::CreationInProgress(
                        channel.to_string(),
                    )));
                }
                Ok("a creation abandoned before it was finished")
            }
            Err(e) => Err(open_error(channel, name, INIT_WAIT, e)),
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
        validate_channel_name(channel)?;
        let name = segment_name(channel);
        // A creator may still be writing: `open_versioned` waits (bounded) for the stamp.
        // SYNC POINT: stamp. Acquire, in `open_versioned`'s look: pairs with the Release store of
        // the stamp in `create`; the fields read in `checked` are the creator's.
        let seg = versioned::open_versioned::<Header>(&name, allow_group, init_wait)
            .map_err(|e| open_error(channel, &name, init_wait, e))?;
        Self::checked(seg, &name)
    }

    /// The layout's own checks of a stamped segment of this magic and version: the counts and
    /// the size its header claims.
    fn checked(seg: Segment, name: &str) -> Result<Control> {
        let h = versioned::header::<Header>(&seg);
        let buffers = h.buffers.load(Ordering::Relaxed) as usize;
        let consumers = h.consumers.load(Ordering::Relaxed) as usize;
        if !(1..=MAX_BUFFERS).contains(&buffers) || !(1..=MAX_CONSUMERS).contains(&consumers) {
            return Err(bad(format!(
                "{name} claims {buffers} buffers and {consumers} consumers: corrupted"
            )));
        }
        let need = segment_len(buffers, consumers);
        if seg.len() < need || h.segment_bytes.load(Ordering::Relaxed) != need as u64 {
            return Err(bad(format!(
                "{name} holds {} bytes but its header needs {need}: truncated or corrupted",
                seg.len()
            )));
        }
        Ok(Control {
            seg,
            buffers,
            consumers,
        })
    }

    fn header(&self) -> &Header {
        // SAFETY: the mapping holds at least a Header (checked at create/open), is page aligned,
        // and Header is only atomics, so a shared reference to it is sound even though other
        // processes write it.
        unsafe { &*self.seg.as_ptr().cast::<Header>() }
    }

    fn buffer_ptr(&self, i: usize) -> *mut BufferSlot {
        debug_assert!(i < self.buffers.max(1));
        // SAFETY: the offset stays inside the mapping: i < buffers and the length was checked.
        unsafe { self.seg.as_ptr().add(buffer_offset(i)).cast() }
    }

    fn buffer(&self, i: usize) -> &BufferSlot {
        // SAFETY: in bounds (see buffer_ptr), 8-byte aligned (sizes are multiples of 8 after a
        // page-aligned base); only the atomic fields are read through this reference, the token
        // bytes through raw-pointer copies.
        unsafe { &*self.buffer_ptr(i) }
    }

    fn consumer_ptr(&self, c: usize) -> *mut ConsumerSlot {
        // SAFETY: in bounds: c < consumers and the length was checked.
        unsafe {
            self.seg
                .as_ptr()
                .add(consumer_offset(self.buffers, c))
                .cast()
        }
    }

    fn consumer(&self, c: usize) -> &ConsumerSlot {
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

    /// The tokens of buffer `i`: (memory, producer event).
    pub(crate) fn buffer_tokens(&self, i: usize) -> ([u8; TOKEN_LEN], [u8; TOKEN_LEN]) {
        let mut mem = [0u8; TOKEN_LEN];
        let mut ev = [0u8; TOKEN_LEN];
        let p = self.buffer_ptr(i);
        // SAFETY: the token area of slot i is inside the mapping and immutable after the stamp
        // (read after `open` Acquire-loaded it); copied out byte-wise, never referenced.
        unsafe {
            let src = std::ptr::addr_of!((*p).tokens).cast::<u8>();
            std::ptr::copy_nonoverlapping(src, mem.as_mut_ptr(), TOKEN_LEN);
            std::ptr::copy_nonoverlapping(src.add(TOKEN_LEN), ev.as_mut_ptr(), TOKEN_LEN);
        }
        (mem, ev)
    }

    pub(crate) fn producer(&self) -> ProcessIdentity {
        let h = self.header();
        ProcessIdentity {
            pid: h.producer_pid.load(Ordering::Relaxed),
            start_time: h.producer_start_time.load(Ordering::Relaxed),
            boot_id: boot_bytes([
                h.producer_boot_id[0].load(Ordering::Relaxed),
                h.producer_boot_id[1].load(Ordering::Relaxed),
            ]),
            pid_ns: h.producer_pid_ns.load(Ordering::Relaxed),
        }
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

    fn bump(word: &AtomicU32) {
        // SYNC POINT: futex. Release: pairs with the Acquire load of the word before a futex wait
        // in `wait_until`; a woken waiter re-checks its condition and sees the change made before
        // this bump.
        word.fetch_add(1, Ordering::Release);
        futex::wake(word, u32::MAX);
    }

    /// Waits on `word` until `ready()` returns `Some`, the timeout runs out (`Ok(None)`), or
    /// `gone()` reports an error (checked every [`LIVENESS_EVERY`]).
    fn wait_until<T>(
        word: &AtomicU32,
        strategy: WaitStrategy,
        timeout: Option<Duration>,
        mut ready: impl FnMut() -> Result<Option<T>>,
        mut gone: impl FnMut() -> Result<()>,
    ) -> Result<Option<T>> {
        let start = Instant::now();
        let mut last_check = start;
        let spin_for = match strategy {
            WaitStrategy::Block => Duration::ZERO,
            WaitStrategy::SpinThenBlock(d) => d,
            WaitStrategy::Spin => Duration::MAX,
        };
        loop {
            // SYNC POINT: futex. Acquire: pairs with the Release bump in `bump`; read before the
            // condition so a change made after the check is seen as a changed word by the futex
            // wait.
            let seen = word.load(Ordering::Acquire);
            if let Some(v) = ready()? {
                return Ok(Some(v));
            }
            let now = Instant::now();
            let waited = now - start;
            if timeout.is_some_and(|t| waited >= t) {
                return Ok(None);
            }
            if now - last_check >= LIVENESS_EVERY {
                gone()?;
                last_check = now;
            }
            if waited < spin_for {
                std::hint::spin_loop();
                continue;
            }
            let mut slice = LIVENESS_EVERY;
            if let Some(t) = timeout {
                slice = slice.min(t.saturating_sub(waited));
            }
            futex::wait(word, seen, slice);
        }
    }

    // ---------------------------------------------------------------- producer side

    /// Takes a free buffer for writing: one no consumer holds and every every-frame consumer has
    /// received (or that holds the oldest frame). Returns (index, consumers whose release events the
    /// write must wait on). Reclaims dead consumers' holds while waiting.
    pub(crate) fn acquire(
        &self,
        strategy: WaitStrategy,
        timeout: Option<Duration>,
    ) -> Result<Option<(usize, u64)>> {
        let h = self.header();
        Self::wait_until(
            &h.release_futex,
            strategy,
            timeout,
            || Ok(self.try_acquire()),
            {
                let mut every = Every::new(SUPERSEDED_EVERY);
                move || {
                    self.reclaim_dead_consumers();
                    if every.due() {
                        self.check_superseded()?;
                    }
                    Ok(())
                }
            },
        )
    }

    fn min_lossless_cursor(&self) -> u64 {
        let mut min = u64::MAX;
        for c in 0..self.consumers {
            let s = self.consumer(c);
            // SYNC POINT: attach. Acquire: pairs with the Release store of ACTIVE in `attach`: its
            // policy and cursor are visible.
            if s.state.load(Ordering::Acquire) == ACTIVE
                && s.policy.load(Ordering::Relaxed) == EVERY_FRAME
            {
                // SYNC POINT: cursor. Acquire: pairs with the Release store of the cursor in
                // `try_take`.
                min = min.min(s.cursor.load(Ordering::Acquire));
            }
        }
        min
    }

    pub(crate) fn try_acquire(&self) -> Option<(usize, u64)> {
        let min_cursor = self.min_lossless_cursor();
        let head = self.head();
        // Oldest first, so the newest frame stays available to latest-only consumers.
        // SYNC POINT: publish. Acquire: pairs with the Release stores of `seq` (`publish`,
        // `abandon`, a claim given back).
        let mut order: Vec<(u64, usize)> = (0..self.buffers)
            .map(|i| (self.buffer(i).seq.load(Ordering::Acquire), i))
            .filter(|&(seq, _)| seq != WRITING && seq <= min_cursor)
            .collect();
        order.sort_unstable();
        for (seq, i) in order {
            if seq == head && seq != 0 && self.buffers > 1 && order_has_other(self, i, min_cursor) {
                // Keep the newest frame while an older buffer is free.
                continue;
            }
            if let Some(used) = self.buffer(i).words().claim(seq) {
                return Some((i, used));
            }
        }
        None
    }

    /// Publishes the frame in buffer `i` (acquired before) with `meta`; returns its sequence number.
    pub(crate) fn publish(&self, i: usize, meta: &[u8]) -> Result<u64> {
        if meta.len() > META_BYTES {
            return Err(Error::InvalidArgument(format!(
                "metadata is {} bytes; at most {META_BYTES}",
                meta.len()
            )));
        }
        let h = self.header();
        let b = self.buffer(i);
        if b.seq.load(Ordering::Relaxed) != WRITING {
            return Err(Error::InvalidArgument(format!(
                "buffer {i} was not acquired"
            )));
        }
        let mut words = [0u64; META_WORDS];
        for (k, chunk) in meta.chunks(8).enumerate() {
            let mut w = [0u8; 8];
            w[..chunk.len()].copy_from_slice(chunk);
            words[k] = u64::from_le_bytes(w);
        }
        // Relaxed: the buffer is WRITING, so no consumer reads these until the Release store of
        // its seq below (SYNC POINT: publish).
        for (k, w) in words.iter().enumerate() {
            b.meta[k].store(*w, Ordering::Relaxed);
        }
        b.meta_len.store(meta.len() as u32, Ordering::Relaxed);
        // Only this producer writes head, so load + store is race-free.
        let seq = h.head.load(Ordering::Relaxed) + 1;
        // SYNC POINT: publish. Release: pairs with consumers' Acquire loads of seq in `try_take`
        // (and the producer's in `try_acquire`); the metadata, and on a host channel the bytes
        // written to the buffer, are visible with it.
        b.seq.store(seq, Ordering::Release);
        // SYNC POINT: head. Release: pairs with `head()`'s Acquire.
        h.head.store(seq, Ordering::Release);
        h.published.fetch_add(1, Ordering::Relaxed);
        Self::bump(&h.publish_futex);
        Ok(seq)
    }

    /// The sequence number the next [`Control::publish`] will give (only the producer calls this).
    pub(crate) fn next_seq(&self) -> u64 {
        self.header().head.load(Ordering::Relaxed) + 1
    }

    /// The ready page: its address in this mapping (page aligned) and its length in bytes. Word
    /// `i` (a `u32` at byte `4 * i`) holds the low 32 bits of the sequence number of the last frame
    /// whose write in buffer `i` finished on the producer's GPU stream (`cuStreamWriteValue32`);
    /// consumers' streams wait on it (`cuStreamWaitValue32`, `GEQ`, which compares with
    /// wrap-around).
    pub(crate) fn ready_page(&self) -> (*mut u8, usize) {
        let off = ready_offset(self.buffers, self.consumers);
        // SAFETY: the segment is at least `layout_len` long (checked at create/open), so the page
        // lies inside the mapping.
        (unsafe { self.seg.as_ptr().add(off) }, READY_PAGE)
    }

    fn ready_word(&self, i: usize) -> &AtomicU32 {
        assert!(i < self.buffers);
        // SAFETY: in bounds (i < buffers <= MAX_BUFFERS, 4 bytes each, inside the page) and
        // 4-byte aligned (the page is page aligned).
        unsafe {
            &*self
                .ready_page()
                .0
                .add(ready_word_offset(i))
                .cast::<AtomicU32>()
        }
    }

    /// Marks every published frame ready, as if its producer's write had finished: for a consumer
    /// whose producer died, so that its stream, waiting for a write that will never finish, drains
    /// (the driver never completes a dead process's work). The frames may hold partial data.
    pub(crate) fn force_ready(&self) {
        for i in 0..self.buffers {
            // SYNC POINT: publish. Acquire: pairs with the Release store of seq in `publish`.
            let seq = self.buffer(i).seq.load(Ordering::Acquire);
            if seq == SEQ_EMPTY || seq == WRITING {
                continue;
            }
            let want = seq as u32;
            let w = self.ready_word(i);
            let mut cur = w.load(Ordering::Relaxed);
            // Raise only (the word compares with wrap-around): never lower what a live producer set.
            // SYNC POINT: ready word. AcqRel: pairs with `set_ready`'s Release store, other
            // consumers' raises and `ready_value`'s Acquire load (on the GPU: the producer
            // stream's `cuStreamWriteValue32` and the consumers' `cuStreamWaitValue32`).
            while (want.wrapping_sub(cur) as i32) > 0 {
                match w.compare_exchange_weak(cur, want, Ordering::AcqRel, Ordering::Relaxed) {
                    Ok(_) => break,
                    Err(c) => cur = c,
                }
            }
        }
    }

    /// Sets buffer `i`'s ready word from the host (the producer, when it could not enqueue the
    /// GPU-side write after publishing `seq`).
    pub(crate) fn set_ready(&self, i: usize, seq: u64) {
        // SYNC POINT: ready word. Release: pairs with `ready_value`'s Acquire and the raises in
        // `force_ready`.
        self.ready_word(i).store(seq as u32, Ordering::Release);
    }

    /// The ready word of buffer `i` as it is now (for tests and tools).
    pub(crate) fn ready_value(&self, i: usize) -> u32 {
        // SYNC POINT: ready word. Acquire: pairs with `set_ready` and `force_ready`.
        self.ready_word(i).load(Ordering::Acquire)
    }

    /// Consumers that held buffer `i` since the producer last wrote it (and clears the mask).
    pub(crate) fn take_used(&self, i: usize) -> u64 {
        // SYNC POINT: used. AcqRel: pairs with the consumers' fetch_or in `HoldWords::hold`.
        self.buffer(i).used_mask.swap(0, Ordering::AcqRel)
    }

    /// Gives an acquired buffer back without publishing (its previous frame is gone: seq 0).
    pub(crate) fn abandon(&self, i: usize) {
        // SYNC POINT: publish. Release: pairs with `try_acquire`/`try_take` Acquire loads of seq.
        self.buffer(i).seq.store(SEQ_EMPTY, Ordering::Release);
        Self::bump(&self.header().release_futex);
    }

    /// The generation of consumer slot `c` when it is active: a cheap check, per acquire, of whether
    /// the consumer there is the one whose release events the producer already opened.
    pub(crate) fn consumer_generation(&self, c: usize) -> Option<u64> {
        let s = self.consumer(c);
        // SYNC POINT: attach. Acquire: pairs with the Release store of ACTIVE in `attach`.
        let g = s.generation.load(Ordering::Acquire);
        (s.state.load(Ordering::Acquire) == ACTIVE).then_some(g)
    }

    /// Consumers (bit mask) whose slots hold live state, with generation numbers, for the producer to
    /// import their release events.
    pub(crate) fn consumer_release_tokens(&self, c: usize) -> Option<(u64, Vec<[u8; TOKEN_LEN]>)> {
        let s = self.consumer(c);
        // SYNC POINT: attach. Acquire: pairs with the Release store of ACTIVE in `attach` (tokens
        // written before it).
        let g0 = s.generation.load(Ordering::Acquire);
        if s.state.load(Ordering::Acquire) != ACTIVE {
            return None;
        }
        let p = self.consumer_ptr(c);
        let mut out = Vec::with_capacity(self.buffers);
        for i in 0..self.buffers {
            let mut t = [0u8; TOKEN_LEN];
            // SAFETY: inside slot c's token area in the mapping; copied byte-wise. A concurrent
            // re-claim is detected by the generation re-check below (and the tokens' checksum).
            unsafe {
                let src = std::ptr::addr_of!((*p).tokens)
                    .cast::<u8>()
                    .add(i * TOKEN_LEN);
                std::ptr::copy_nonoverlapping(src, t.as_mut_ptr(), TOKEN_LEN);
            }
            out.push(t);
        }
        // SYNC POINT: claim generation. Acquire fence, then re-check: pairs with the Release fence
        // after the generation bump in `attach`; the copy above belongs to generation g0 only if
        // unchanged.
        fence(Ordering::Acquire);
        (s.generation.load(Ordering::Relaxed) == g0).then_some((g0, out))
    }

    /// The identity recorded in consumer slot `c` (whatever its state).
    pub(crate) fn consumer_identity(&self, c: usize) -> ProcessIdentity {
        let s = self.consumer(c);
        ProcessIdentity {
            pid: s.pid.load(Ordering::Relaxed),
            start_time: s.start_time.load(Ordering::Relaxed),
            boot_id: boot_bytes([
                s.boot_id[0].load(Ordering::Relaxed),
                s.boot_id[1].load(Ordering::Relaxed),
            ]),
            pid_ns: s.pid_ns.load(Ordering::Relaxed),
        }
    }

    /// Puts back consumer bits taken from buffer `i`'s used mask (the write did not happen).
    pub(crate) fn restore_used(&self, i: usize, bits: u64) {
        // SYNC POINT: used. AcqRel: as `take_used`.
        self.buffer(i).used_mask.fetch_or(bits, Ordering::AcqRel);
    }

    /// Releases the holds of consumers whose process died; returns how many holds were forced.
    pub(crate) fn reclaim_dead_consumers(&self) -> u64 {
        let mut forced = 0;
        for c in 0..self.consumers {
            let s = self.consumer(c);
            // SYNC POINT: attach. Acquire: pairs with the Release store of ACTIVE in `attach`.
            let st = s.state.load(Ordering::Acquire);
            if st == FREE {
                continue;
            }
            let id = ProcessIdentity {
                pid: s.pid.load(Ordering::Relaxed),
                start_time: s.start_time.load(Ordering::Relaxed),
                boot_id: boot_bytes([
                    s.boot_id[0].load(Ordering::Relaxed),
                    s.boot_id[1].load(Ordering::Relaxed),
                ]),
                pid_ns: s.pid_ns.load(Ordering::Relaxed),
            };
            if id.liveness() != Liveness::Dead {
                continue;
            }
            forced += self.free_consumer_slot(c, st);
        }
        if forced > 0 {
            self.header()
                .forced_releases
                .fetch_add(forced, Ordering::Relaxed);
        }
        forced
    }

    fn free_consumer_slot(&self, c: usize, expected_state: u32) -> u64 {
        let s = self.consumer(c);
        let bit = 1u64 << c;
        let mut forced = 0;
        for i in 0..self.buffers {
            let b = self.buffer(i);
            // SYNC POINT: release. AcqRel: pairs with the producer's loads of hold_mask in
            // `HoldWords::claim`, as the consumer's own release does.
            if b.hold_mask.fetch_and(!bit, Ordering::AcqRel) & bit != 0 {
                forced += 1;
            }
            // Its release events die with it: the producer must not wait on them.
            // SYNC POINT: used. AcqRel: as `take_used`.
            b.used_mask.fetch_and(!bit, Ordering::AcqRel);
        }
        // SYNC POINT: slot free. Release: pairs with `attach`'s CAS (Acquire) when the slot is
        // claimed again.
        let _ = s
            .state
            .compare_exchange(expected_state, FREE, Ordering::AcqRel, Ordering::Relaxed);
        Self::bump(&self.header().release_futex);
        forced
    }

    /// Marks the channel closed and wakes every consumer.
    pub(crate) fn close(&self) {
        // SYNC POINT: closed. Release: pairs with `is_closed`'s Acquire.
        self.header()
            .producer_state
            .store(CLOSED, Ordering::Release);
        Self::bump(&self.header().publish_futex);
    }

    /// Holds outstanding now, over all buffers.
    pub(crate) fn outstanding_holds(&self) -> u32 {
        (0..self.buffers)
            .map(|i| {
                // SYNC POINT: release. Acquire: pairs with the consumers' clears in `release`.
                self.buffer(i)
                    .hold_mask
                    .load(Ordering::Acquire)
                    .count_ones()
            })
            .sum()
    }

    /// Waits (bounded) until every every-frame consumer received every published frame and no
    /// consumer holds a buffer; then withdraws every buffer (no consumer can take a frame after
    /// this) and forces the holds left. Returns the number of holds forced.
    pub(crate) fn drain(&self, timeout: Duration) -> u64 {
        let h = self.header();
        let _ = Self::wait_until(
            &h.release_futex,
            WaitStrategy::Block,
            Some(timeout),
            || {
                let done =
                    self.outstanding_holds() == 0 && self.min_lossless_cursor() >= self.head();
                Ok(done.then_some(()))
            },
            || {
                self.reclaim_dead_consumers();
                Ok(())
            },
        );
        let mut forced = 0;
        for i in 0..self.buffers {
            forced += u64::from(self.buffer(i).words().withdraw());
        }
        if forced > 0 {
            h.forced_releases.fetch_add(forced, Ordering::Relaxed);
        }
        forced
    }

    // ---------------------------------------------------------------- consumer side

    /// Claims a consumer slot; `release_tokens[i]` is the consumer's event token for buffer `i`.
    /// Starts at the current head (frames published before attaching are not delivered).
    pub(crate) fn attach(
        &self,
        policy: Delivery,
        release_tokens: &[[u8; TOKEN_LEN]],
    ) -> Result<usize> {
        if release_tokens.len() != self.buffers {
            return Err(Error::InvalidArgument(format!(
                "{} release tokens for {} buffers",
                release_tokens.len(),
                self.buffers
            )));
        }
        self.reclaim_dead_consumers();
        let me = ProcessIdentity::current()?;
        for c in 0..self.consumers {
            let s = self.consumer(c);
            // SYNC POINT: slot free. Acquire on success: pairs with the Release that freed the slot
            // (`free_consumer_slot`).
            if s.state
                .compare_exchange(FREE, CLAIMING, Ordering::Acquire, Ordering::Relaxed)
                .is_err()
            {
                continue;
            }
            s.generation.fetch_add(1, Ordering::Relaxed);
            // SYNC POINT: claim generation. Release fence: pairs with the Acquire fence before
            // the generation re-check in `consumer_release_tokens`: a producer that copied any
            // token written below sees the new generation and drops its copy.
            fence(Ordering::Release);
            s.pid.store(me.pid, Ordering::Relaxed);
            s.start_time.store(me.start_time, Ordering::Relaxed);
            let bw = boot_words(&me);
            s.boot_id[0].store(bw[0], Ordering::Relaxed);
            s.boot_id[1].store(bw[1], Ordering::Relaxed);
            s.pid_ns.store(me.pid_ns, Ordering::Relaxed);
            s.policy.store(policy.to_wire(), Ordering::Relaxed);
            s.received.store(0, Ordering::Relaxed);
            s.dropped.store(0, Ordering::Relaxed);
            let p = self.consumer_ptr(c);
            for (i, t) in release_tokens.iter().enumerate() {
                // SAFETY: inside slot c's token area; this process owns the slot (CLAIMING), and
                // the producer reads the area only when ACTIVE with a generation re-check.
                unsafe {
                    let dst = std::ptr::addr_of_mut!((*p).tokens)
                        .cast::<u8>()
                        .add(i * TOKEN_LEN);
                    std::ptr::copy_nonoverlapping(t.as_ptr(), dst, TOKEN_LEN);
                }
            }
            s.cursor.store(self.head(), Ordering::Relaxed);
            // SYNC POINT: attach. Release: pairs with the producer's Acquire loads of state; all of
            // the above is visible.
            s.state.store(ACTIVE, Ordering::Release);
            return Ok(c);
        }
        Err(Error::Channel(super::ChannelError::NoConsumerSlot(
            self.consumers,
        )))
    }

    /// Leaves the channel: drops any holds and frees the slot.
    pub(crate) fn detach(&self, c: usize) {
        self.free_consumer_slot(c, ACTIVE);
    }

    /// Whether the producer is gone: closed, or its process dead.
    pub(crate) fn producer_gone(&self) -> Result<()> {
        let p = self.producer();
        if p.liveness() == Liveness::Dead {
            return Err(Error::ProducerGone { pid: p.pid });
        }
        Ok(())
    }

    /// Takes the next frame for consumer `c` (by its policy), holding its buffer. Returns
    /// (buffer index, sequence number, metadata) or `None` at the timeout.
    ///
    /// # Errors
    /// [`Error::ProducerGone`] when the producer died; [`Error::ChannelClosed`] when it closed and
    /// no frame is left for this consumer.
    pub(crate) fn take(
        &self,
        c: usize,
        strategy: WaitStrategy,
        timeout: Option<Duration>,
    ) -> Result<Option<(usize, u64, Vec<u8>)>> {
        let h = self.header();
        Self::wait_until(
            &h.publish_futex,
            strategy,
            timeout,
            || self.take_or_closed(c),
            {
                let mut every = Every::new(SUPERSEDED_EVERY);
                move || {
                    self.producer_gone()?;
                    if every.due() {
                        self.check_superseded()?;
                    }
                    Ok(())
                }
            },
        )
    }

    /// [`super::ChannelError::Superseded`] when the channel's name now stands for another segment
    /// (removed and made again): one `stat`, on the slow path of a wait only.
    pub(crate) fn check_superseded(&self) -> Result<()> {
        if self.seg.name_is_still_this() {
            return Ok(());
        }
        let name = self.seg.name();
        Err(Error::Channel(super::ChannelError::Superseded(
            name.strip_prefix(SEGMENT_PREFIX)
                .unwrap_or(name)
                .to_string(),
        )))
    }

    /// The creation generation written in the header (random, nonzero).
    pub(crate) fn generation(&self) -> u64 {
        // Relaxed: written once before the stamp, which the opener Acquire-loaded.
        self.header().generation.load(Ordering::Relaxed)
    }

    pub(crate) fn try_take(&self, c: usize) -> Result<Option<(usize, u64, Vec<u8>)>> {
        let s = self.consumer(c);
        // SYNC POINT: attach. Acquire: pairs with the Release store of ACTIVE in `attach`.
        if s.state.load(Ordering::Acquire) != ACTIVE {
            return Err(Error::Channel(super::ChannelError::Detached));
        }
        let latest = s.policy.load(Ordering::Relaxed) == LATEST_ONLY;
        let bit = 1u64 << c;
        loop {
            let head = self.head();
            let cursor = s.cursor.load(Ordering::Relaxed);
            if head <= cursor {
                return Ok(None);
            }
            // Every-frame: the next one; if it is gone (only possible before this consumer was
            // counted, at attach), the oldest still present. Latest-only: the newest.
            let want = if latest { head } else { cursor + 1 };
            let mut found = None;
            let mut oldest: Option<(u64, usize)> = None;
            for i in 0..self.buffers {
                // SYNC POINT: publish. Acquire: pairs with the Release store of seq in `publish`.
                let seq = self.buffer(i).seq.load(Ordering::Acquire);
                if seq == want {
                    found = Some(i);
                }
                if seq != WRITING && seq > cursor && oldest.is_none_or(|(o, _)| seq < o) {
                    oldest = Some((seq, i));
                }
            }
            let (seq, i) = match (found, oldest) {
                (Some(i), _) => (want, i),
                (None, Some(o)) if !latest => o,
                // The wanted frame is being overwritten (a pool of one buffer) or not visible
                // yet: nothing to take now; the caller waits for the next publish.
                _ => return Ok(None),
            };
            let b = self.buffer(i);
            if !b.words().hold(bit, seq) {
                // The producer took it meanwhile: undone; look again.
                Self::bump(&self.header().release_futex);
                continue;
            }
            let len = (b.meta_len.load(Ordering::Relaxed) as usize).min(META_BYTES);
            let mut meta = Vec::with_capacity(META_BYTES);
            for k in 0..META_WORDS {
                meta.extend_from_slice(&b.meta[k].load(Ordering::Relaxed).to_le_bytes());
            }
            meta.truncate(len);
            s.dropped.fetch_add(seq - cursor - 1, Ordering::Relaxed);
            s.received.fetch_add(1, Ordering::Relaxed);
            // SYNC POINT: cursor. Release: pairs with the producer's Acquire of cursors in
            // `min_lossless_cursor`.
            s.cursor.store(seq, Ordering::Release);
            Self::bump(&self.header().release_futex);
            return Ok(Some((i, seq, meta)));
        }
    }

    /// [`Control::try_take`], or [`Error::ChannelClosed`] when nothing is left for consumer `c` and
    /// the producer closed the channel.
    ///
    /// A `None` from `try_take` followed by seeing the channel closed is not enough: the producer
    /// may have published more frames and closed between the two. Seeing `closed` (Acquire, paired
    /// with the Release store in `close`, which follows the last publish) makes every publish
    /// visible, so one more look is conclusive.
    pub(crate) fn take_or_closed(&self, c: usize) -> Result<Option<(usize, u64, Vec<u8>)>> {
        if let Some(got) = self.try_take(c)? {
            return Ok(Some(got));
        }
        if !self.is_closed() {
            return Ok(None);
        }
        match self.try_take(c)? {
            Some(got) => Ok(Some(got)),
            None => Err(Error::ChannelClosed),
        }
    }

    /// Ends consumer `c`'s hold on buffer `i` (after its release event was recorded).
    pub(crate) fn release(&self, c: usize, i: usize) {
        self.buffer(i).words().release(1u64 << c);
        Self::bump(&self.header().release_futex);
    }

    /// Counters of the channel.
    pub(crate) fn stats(&self) -> ChannelStats {
        let h = self.header();
        let head = self.head();
        let mut consumers = Vec::new();
        for c in 0..self.consumers {
            let s = self.consumer(c);
            // SYNC POINT: attach. Acquire: pairs with the Release store of ACTIVE in `attach`.
            if s.state.load(Ordering::Acquire) != ACTIVE {
                continue;
            }
            let bit = 1u64 << c;
            consumers.push(ConsumerStats {
                index: c,
                pid: s.pid.load(Ordering::Relaxed),
                received: s.received.load(Ordering::Relaxed),
                dropped: s.dropped.load(Ordering::Relaxed),
                in_flight: (0..self.buffers)
                    .filter(|&i| self.buffer(i).hold_mask.load(Ordering::Relaxed) & bit != 0)
                    .count() as u32,
                lag: head.saturating_sub(s.cursor.load(Ordering::Relaxed)),
            });
        }
        ChannelStats {
            published: h.published.load(Ordering::Relaxed),
            head,
            forced_releases: h.forced_releases.load(Ordering::Relaxed),
            consumers,
        }
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

/// Whether some buffer other than `i` could take the write (free and consumed).
fn order_has_other(c: &Control, i: usize, min_cursor: u64) -> bool {
    (0..c.buffers).any(|j| {
        j != i && {
            let b = c.buffer(j);
            // SYNC POINT: publish, release. Acquire: pairs with the Release stores of seq and the
            // consumers' clears of hold_mask.
            let seq = b.seq.load(Ordering::Acquire);
            seq != WRITING && seq <= min_cursor && b.hold_mask.load(Ordering::Acquire) == 0
        }
    })
}

impl BufferSlot {
    /// The words of this slot that the hold protocol touches.
    fn words(&self) -> HoldWords<'_> {
        HoldWords {
            seq: &self.seq,
            hold_mask: &self.hold_mask,
            used_mask: &self.used_mask,
        }
    }
}

/// The hold protocol of one buffer (docs/channel-layout.md, "A buffer's seq word and hold mask"),
/// on plain references to atomics, so that the loom model below runs the same code on heap memory
/// that the channel runs on the mapped segment.
///
/// The Dekker pair (SYNC POINT: hold): the producer's claim stores `seq` := [`WRITING`] and then
/// loads `hold_mask`; a consumer's hold sets its bit in `hold_mask` and then loads `seq`. Each side
/// puts a `SeqCst` fence between its store and its load, so of any claim and hold on one buffer at
/// least one sees the other and backs off. (The accesses are `SeqCst` too, which would suffice by
/// itself; the fences are what loom models, see `loom_channel_*`.)
pub(crate) struct HoldWords<'a> {
    /// `BufferSlot::seq`.
    pub(crate) seq: &'a AtomicU64,
    /// `BufferSlot::hold_mask`.
    pub(crate) hold_mask: &'a AtomicU64,
    /// `BufferSlot::used_mask`.
    pub(crate) used_mask: &'a AtomicU64,
}

impl HoldWords<'_> {
    /// The producer's claim of the buffer for writing, whose `seq` it read as `seq` (not
    /// [`WRITING`]): `seq` := [`WRITING`] unless a consumer holds the frame. Returns the consumers
    /// that read the buffer since its last write (their release events come before the write), or
    /// `None` when it is held or changed meanwhile (then it is as it was).
    pub(crate) fn claim(&self, seq: u64) -> Option<u64> {
        // SYNC POINT: release. SeqCst (an acquire): pairs with the consumers' clears of their bits
        // (`release`, `free_consumer_slot`): a mask seen clear comes after every read of the frame.
        if self.hold_mask.load(Ordering::SeqCst) != 0 {
            return None;
        }
        // SYNC POINT: hold. SeqCst, then a SeqCst fence: the producer half of the Dekker pair with
        // `hold`. A consumer that sets its bit after the fence sees WRITING.
        if self
            .seq
            .compare_exchange(seq, WRITING, Ordering::SeqCst, Ordering::SeqCst)
            .is_err()
        {
            return None;
        }
        fence(Ordering::SeqCst);
        // SYNC POINT: hold, release. SeqCst: a hold set before the fence above is seen here; a
        // mask seen clear comes after every earlier release (as above).
        if self.hold_mask.load(Ordering::SeqCst) != 0 {
            // SYNC POINT: publish. Release: given back unchanged; pairs with the Acquire loads of
            // seq.
            self.seq.store(seq, Ordering::Release);
            return None;
        }
        // SYNC POINT: used. AcqRel: pairs with the consumers' fetch_or in `hold`.
        Some(self.used_mask.swap(0, Ordering::AcqRel))
    }

    /// A consumer's hold (its `bit` in `hold_mask`) on the frame `seq` it found in the buffer:
    /// `true` when held; `false` when the producer took the buffer meanwhile (the bit is cleared
    /// again).
    pub(crate) fn hold(&self, bit: u64, seq: u64) -> bool {
        // SYNC POINT: hold. SeqCst, then a SeqCst fence: the consumer half of the Dekker pair with
        // `claim` and `withdraw`.
        self.hold_mask.fetch_or(bit, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        // SYNC POINT: hold, publish. SeqCst (an acquire): a claim before the fence above is seen
        // as WRITING; a frame seen is the one published with its metadata and bytes.
        if self.seq.load(Ordering::SeqCst) != seq {
            // SYNC POINT: release. SeqCst: as `release`.
            self.hold_mask.fetch_and(!bit, Ordering::SeqCst);
            return false;
        }
        // SYNC POINT: used. AcqRel: pairs with the producer's swap in `claim` (`take_used`).
        self.used_mask.fetch_or(bit, Ordering::AcqRel);
        true
    }

    /// Ends the hold of the consumer of `bit` (after its release event was recorded, and on a
    /// host channel after its last read of the buffer).
    pub(crate) fn release(&self, bit: u64) {
        // SYNC POINT: release. SeqCst (a release): the release event recorded and the reads done
        // before this come before the producer's next write, which waits for a clear mask in
        // `claim`.
        self.hold_mask.fetch_and(!bit, Ordering::SeqCst);
    }

    /// Withdraws the buffer at close (`seq` := [`WRITING`] for good) and clears every hold;
    /// returns how many holds there were. A consumer whose hold comes after this sees WRITING and
    /// backs off; one before is counted.
    pub(crate) fn withdraw(&self) -> u32 {
        // SYNC POINT: hold. SeqCst, then a SeqCst fence: the producer half of the Dekker pair with
        // `hold`, as in `claim`.
        self.seq.store(WRITING, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        self.hold_mask.swap(0, Ordering::SeqCst).count_ones()
    }
}

#[cfg(all(test, loom))]
mod loom_model {
    //! Model of one buffer's holds and releases ([`HoldWords`]): a producer claims and rewrites
    //! the buffer while consumers hold, read and release its frame. The buffer's bytes are a loom
    //! `UnsafeCell`, so loom fails the model on any write that is not ordered after every read of
    //! the frame before it (and any read not after its write): a buffer is never written while
    //! held, and on a host channel the bytes a consumer reads are the frame's.
    use super::*;
    use loom::cell::UnsafeCell;
    use loom::sync::Arc;

    struct Buf {
        seq: AtomicU64,
        hold_mask: AtomicU64,
        used_mask: AtomicU64,
        /// The buffer's bytes: the sequence number of the frame written there.
        data: UnsafeCell<u64>,
    }

    // SAFETY: `data` is only touched through loom's checked accessors, in the model.
    unsafe impl Sync for Buf {}

    impl Buf {
        /// A buffer holding frame 1.
        fn published() -> Arc<Self> {
            Arc::new(Buf {
                seq: AtomicU64::new(1),
                hold_mask: AtomicU64::new(0),
                used_mask: AtomicU64::new(0),
                data: UnsafeCell::new(1),
            })
        }
        fn words(&self) -> HoldWords<'_> {
            HoldWords {
                seq: &self.seq,
                hold_mask: &self.hold_mask,
                used_mask: &self.used_mask,
            }
        }
    }

    /// A consumer's take of the frame in the buffer, as `try_take` does it: the read is checked
    /// against the frame's number; the hold ends after it. Returns the frame taken.
    fn take(b: &Buf, bit: u64) -> Option<u64> {
        // SYNC POINT: publish (as in `try_take`).
        let seq = b.seq.load(Ordering::Acquire);
        if seq == SEQ_EMPTY || seq == WRITING || !b.words().hold(bit, seq) {
            return None;
        }
        // SAFETY: loom checks this read against every write of the model.
        let got = b.data.with(|p| unsafe { *p });
        assert_eq!(
            got, seq,
            "read frame {seq}'s buffer while frame {got} was in it"
        );
        b.words().release(bit);
        Some(seq)
    }

    /// The producer's write of frame `next`, as `try_acquire` and `publish` do it. Returns the
    /// consumers whose release events the write waited on, or `None` when it did not write.
    fn write(b: &Buf, next: u64) -> Option<u64> {
        // SYNC POINT: publish (as in `try_acquire`).
        let seq = b.seq.load(Ordering::Acquire);
        if seq == WRITING {
            return None;
        }
        let used = b.words().claim(seq)?;
        // SAFETY: loom checks this write against every read of the model.
        b.data.with_mut(|p| unsafe { *p = next });
        // SYNC POINT: publish (as in `publish`).
        b.seq.store(next, Ordering::Release);
        Some(used)
    }

    fn builder() -> loom::model::Builder {
        let mut b = loom::model::Builder::new();
        b.preemption_bound = Some(3);
        b
    }

    #[test]
    fn loom_channel_a_held_buffer_is_never_written_and_reads_see_their_frame() {
        builder().check(|| {
            let b = Buf::published();
            let c = b.clone();
            let consumer = loom::thread::spawn(move || (take(&c, 1), take(&c, 1)));
            let used = write(&b, 2);
            let (first, second) = consumer.join().unwrap();
            if let (Some(x), Some(y)) = (first, second) {
                assert!(x <= y, "took frame {x}, then {y}");
            }
            // A write after a read of frame 1 waits on that consumer's release event.
            if let Some(used) = used
                && (first == Some(1) || second == Some(1))
            {
                assert_eq!(used, 1, "the write did not wait on the reader of frame 1");
            }
            assert_eq!(b.hold_mask.load(Ordering::Relaxed), 0);
        });
    }

    #[test]
    fn loom_channel_two_consumers_and_a_producer_never_overlap() {
        builder().check(|| {
            let b = Buf::published();
            let consumers: Vec<_> = [1u64, 2]
                .into_iter()
                .map(|bit| {
                    let c = b.clone();
                    loom::thread::spawn(move || take(&c, bit))
                })
                .collect();
            let wrote = write(&b, 2).is_some();
            for c in consumers {
                c.join().unwrap();
            }
            assert_eq!(b.hold_mask.load(Ordering::Relaxed), 0);
            let seq = b.seq.load(Ordering::Relaxed);
            assert_eq!(seq, if wrote { 2 } else { 1 });
        });
    }

    #[test]
    fn loom_channel_withdraw_counts_every_hold_it_does_not_turn_away() {
        builder().check(|| {
            let b = Buf::published();
            let c = b.clone();
            let consumer = loom::thread::spawn(move || c.words().hold(1, 1));
            let forced = b.words().withdraw();
            let held = consumer.join().unwrap();
            // A hold that succeeded was there when the buffer was withdrawn: counted (and
            // cleared), so close never frees memory a consumer still reads uncounted.
            if held {
                assert_eq!(forced, 1);
            }
            assert_eq!(b.seq.load(Ordering::Relaxed), WRITING);
            assert_eq!(b.hold_mask.load(Ordering::Relaxed), 0);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::token::{Token, TokenKind};
    use std::sync::atomic::AtomicU32 as StdAtomicU32;

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

    fn channel(buffers: usize) -> (Control, String) {
        static N: StdAtomicU32 = StdAtomicU32::new(0);
        let name = format!(
            "test-{}-{}",
            std::process::id(),
            N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let tokens: Vec<_> = (0..buffers as u8)
            .map(|i| (fake_token(i), fake_token(100 + i)))
            .collect();
        let c = Control::create(&name, 64, 4, &tokens, &SegmentOptions::new()).unwrap();
        (c, name)
    }

    fn rel_tokens(n: usize) -> Vec<[u8; TOKEN_LEN]> {
        (0..n as u8).map(|i| fake_token(200 + i)).collect()
    }

    #[test]
    fn channel_names_are_checked_against_the_channel_limit() {
        let long = "c".repeat(MAX_CHANNEL_NAME + 1);
        let e = Control::open(&long).map(|_| ()).unwrap_err().to_string();
        assert!(e.contains(&format!("at most {MAX_CHANNEL_NAME}")), "{e}");
        assert!(!e.contains("cuda-ipc.ch."), "{e}");
        let e = Control::create(
            &long,
            64,
            1,
            &[([0; TOKEN_LEN], [0; TOKEN_LEN])],
            &SegmentOptions::new(),
        )
        .map(|_| ())
        .unwrap_err()
        .to_string();
        assert!(e.contains(&format!("at most {MAX_CHANNEL_NAME}")), "{e}");
        assert!(Control::open("a/b").is_err());
        assert!(Control::open("").is_err());
    }

    #[test]
    fn frames_published_just_before_close_are_still_delivered() {
        // The interleaving that lost frames: the consumer finds nothing new, then the producer
        // publishes and closes, then the consumer sees the channel closed.
        for policy in [Delivery::EveryFrame, Delivery::LatestOnly] {
            let (c, _name) = channel(2);
            let slot = c.attach(policy, &rel_tokens(2)).unwrap();
            assert!(c.try_take(slot).unwrap().is_none());
            let (i, _) = c.try_acquire().unwrap();
            c.publish(i, b"last").unwrap();
            c.close();
            let (_, seq, meta) = c.take_or_closed(slot).unwrap().expect("the last frame");
            assert_eq!((seq, meta.as_slice()), (1, &b"last"[..]));
            c.release(slot, i);
            assert!(matches!(c.take_or_closed(slot), Err(Error::ChannelClosed)));
            c.unlink();
        }
    }

    #[test]
    fn a_consumer_racing_the_producers_close_always_gets_the_last_frame() {
        // Full speed on a pool of 2, both policies, many short runs: the close lands at every
        // point of the consumer's take.
        for policy in [Delivery::EveryFrame, Delivery::LatestOnly] {
            for _ in 0..300 {
                let (c, _name) = channel(2);
                let slot = c.attach(policy, &rel_tokens(2)).unwrap();
                const N: u64 = 40;
                let last = std::thread::scope(|sc| {
                    let consumer = sc.spawn(|| {
                        let mut last = 0;
                        loop {
                            match c.take(slot, WaitStrategy::Spin, Some(Duration::from_secs(10))) {
                                Ok(Some((i, seq, _))) => {
                                    assert!(seq > last);
                                    last = seq;
                                    c.release(slot, i);
                                }
                                Ok(None) => panic!("timed out"),
                                Err(Error::ChannelClosed) => return last,
                                Err(e) => panic!("{e}"),
                            }
                        }
                    });
                    for _ in 0..N {
                        let (i, _) = c
                            .acquire(WaitStrategy::Spin, Some(Duration::from_secs(10)))
                            .unwrap()
                            .unwrap();
                        c.publish(i, b"").unwrap();
                    }
                    c.close();
                    consumer.join().unwrap()
                });
                assert_eq!(last, N, "{policy:?}: the last frame was lost to the close");
                c.unlink();
            }
        }
    }

    #[test]
    fn the_ready_page_is_page_aligned_and_force_ready_only_raises_published_words() {
        let (c, _name) = channel(3);
        let (p, len) = c.ready_page();
        assert_eq!(p as usize % READY_PAGE, 0);
        assert_eq!(len, READY_PAGE);
        assert_eq!(c.seg.len(), ready_offset(3, 4) + READY_PAGE);
        // Buffer 0 published as frame 1, buffer 1 being written, buffer 2 never used.
        let (i, _) = c.try_acquire().unwrap();
        assert_eq!(c.next_seq(), 1);
        assert_eq!(c.publish(i, b"").unwrap(), 1);
        let (j, _) = c.try_acquire().unwrap();
        assert_ne!(i, j);
        c.force_ready();
        assert_eq!(c.ready_value(i), 1);
        assert_eq!(c.ready_value(j), 0, "a buffer being written is not forced");
        // A word ahead of the published seq (wrap-around order) is never lowered.
        c.ready_word(i).store(5, Ordering::Relaxed);
        c.force_ready();
        assert_eq!(c.ready_value(i), 5);
        // Wrap-around: u32::MAX is behind 1.
        c.ready_word(i).store(u32::MAX, Ordering::Relaxed);
        c.force_ready();
        assert_eq!(c.ready_value(i), 1);
        c.unlink();
    }

    #[test]
    fn every_frame_consumer_gets_every_frame_in_order_and_back_pressure_holds_the_producer() {
        let (p, name) = channel(2);
        let c = Control::open(&name).unwrap();
        let me = c.attach(Delivery::EveryFrame, &rel_tokens(2)).unwrap();
        // Two frames fill the pool; a third must wait for the consumer.
        for k in 1..=2u64 {
            let (i, _) = p.try_acquire().expect("free buffer");
            assert_eq!(p.publish(i, &k.to_le_bytes()).unwrap(), k);
        }
        assert!(
            p.try_acquire().is_none(),
            "overwrote a frame the consumer had not received"
        );
        let (i1, s1, m1) = c.try_take(me).unwrap().unwrap();
        assert_eq!((s1, m1), (1, 1u64.to_le_bytes().to_vec()));
        // Received but still held: the buffer is not free yet.
        assert!(p.try_acquire().is_none(), "overwrote a held buffer");
        c.release(me, i1);
        let (i, used) = p.try_acquire().expect("released buffer");
        assert_eq!(i, i1);
        assert_eq!(
            used,
            1 << me,
            "the write must wait on this consumer's release event"
        );
        p.publish(i, b"3").unwrap();
        let (_, s2, _) = c.try_take(me).unwrap().unwrap();
        assert_eq!(s2, 2);
        let st = p.stats();
        assert_eq!(st.published, 3);
        assert_eq!(st.consumers[0].received, 2);
        assert_eq!(st.consumers[0].in_flight, 1);
        assert_eq!(st.consumers[0].lag, 1);
        p.unlink();
    }

    #[test]
    fn latest_only_consumer_skips_and_counts_dropped_frames_without_holding_the_producer_back() {
        let (p, name) = channel(3);
        let c = Control::open(&name).unwrap();
        let me = c.attach(Delivery::LatestOnly, &rel_tokens(3)).unwrap();
        for k in 1..=10u64 {
            let (i, _) = p
                .try_acquire()
                .expect("latest-only must never block the producer");
            p.publish(i, &[]).unwrap();
            assert_eq!(k, p.head());
        }
        let (i, seq, _) = c.try_take(me).unwrap().unwrap();
        assert_eq!(seq, 10);
        assert_eq!(p.stats().consumers[0].dropped, 9);
        // While held, the producer keeps going with the other buffers, never this one.
        for _ in 0..10 {
            let (j, _) = p.try_acquire().unwrap();
            assert_ne!(j, i);
            p.publish(j, &[]).unwrap();
        }
        c.release(me, i);
        assert!(c.try_take(me).unwrap().unwrap().1 == 20);
        p.unlink();
    }

    #[test]
    fn broadcast_waits_for_the_slowest_every_frame_consumer() {
        let (p, name) = channel(2);
        let c = Control::open(&name).unwrap();
        let a = c.attach(Delivery::EveryFrame, &rel_tokens(2)).unwrap();
        let b = c.attach(Delivery::EveryFrame, &rel_tokens(2)).unwrap();
        assert_ne!(a, b);
        let (i, _) = p.try_acquire().unwrap();
        p.publish(i, &[]).unwrap();
        let (i, _) = p.try_acquire().unwrap();
        p.publish(i, &[]).unwrap();
        let (ia, _, _) = c.try_take(a).unwrap().unwrap();
        c.release(a, ia);
        assert!(p.try_acquire().is_none(), "b has not received frame 1");
        let (ib, _, _) = c.try_take(b).unwrap().unwrap();
        c.release(b, ib);
        let (_, used) = p.try_acquire().unwrap();
        assert_eq!(used, (1 << a) | (1 << b));
        p.unlink();
    }

    #[test]
    fn dead_consumer_holds_are_released_and_its_slot_reused() {
        let (p, name) = channel(1);
        let c = Control::open(&name).unwrap();
        let me = c.attach(Delivery::EveryFrame, &rel_tokens(1)).unwrap();
        let (i, _) = p.try_acquire().unwrap();
        p.publish(i, &[]).unwrap();
        c.try_take(me).unwrap().unwrap();
        assert!(p.try_acquire().is_none());
        // Make the slot's owner a process that has exited.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        let st = crate::identity::start_time_of(pid).unwrap().unwrap_or(1);
        child.wait().unwrap();
        let s = c.consumer(me);
        s.pid.store(pid, Ordering::Relaxed);
        s.start_time.store(st, Ordering::Relaxed);
        assert_eq!(p.reclaim_dead_consumers(), 1);
        let (_, used) = p
            .try_acquire()
            .expect("the dead consumer's hold was released");
        assert_eq!(used, 0, "no waiting on a dead consumer's events");
        assert_eq!(p.stats().forced_releases, 1);
        assert!(matches!(
            c.try_take(me),
            Err(Error::Channel(super::super::ChannelError::Detached))
        ));
        let again = c.attach(Delivery::EveryFrame, &rel_tokens(1)).unwrap();
        assert_eq!(again, me);
        p.unlink();
    }

    #[test]
    fn dead_producer_is_reported_and_a_restart_replaces_its_segment() {
        let (p, name) = channel(1);
        let c = Control::open(&name).unwrap();
        let me = c.attach(Delivery::EveryFrame, &rel_tokens(1)).unwrap();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        p.header().producer_pid.store(pid, Ordering::Relaxed);
        let t = Instant::now();
        let r = c.take(me, WaitStrategy::Block, Some(Duration::from_secs(5)));
        assert!(
            matches!(r, Err(Error::ProducerGone { pid: x }) if x == pid),
            "{:?}",
            r.map(|_| ())
        );
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "took {:?}",
            t.elapsed()
        );
        // A new producer replaces the dead one's segment.
        let tokens = [(fake_token(1), fake_token(2))];
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
    fn closed_channel_delivers_what_was_published_then_reports_closed() {
        let (p, name) = channel(2);
        let c = Control::open(&name).unwrap();
        let me = c.attach(Delivery::EveryFrame, &rel_tokens(2)).unwrap();
        let (i, _) = p.try_acquire().unwrap();
        p.publish(i, &[]).unwrap();
        p.close();
        let (i, _, _) = c
            .take(me, WaitStrategy::Block, Some(Duration::from_secs(1)))
            .unwrap()
            .unwrap();
        let r = c.take(me, WaitStrategy::Block, Some(Duration::from_secs(1)));
        assert!(matches!(r, Err(Error::ChannelClosed)));
        // A hold still out is forced at the drain deadline and counted.
        assert_eq!(p.drain(Duration::from_millis(50)), 1);
        c.release(me, i);
        p.unlink();
    }

    #[test]
    fn a_waiting_consumer_is_woken_by_a_publish_from_another_thread() {
        let (p, name) = channel(2);
        let c = Control::open(&name).unwrap();
        let me = c.attach(Delivery::EveryFrame, &rel_tokens(2)).unwrap();
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(50));
                let (i, _) = p.try_acquire().unwrap();
                p.publish(i, b"x").unwrap();
            });
            let got = c
                .take(me, WaitStrategy::Block, Some(Duration::from_secs(5)))
                .unwrap()
                .unwrap();
            assert_eq!(got.2, b"x");
        });
        assert!(
            c.take(me, WaitStrategy::Spin, Some(Duration::from_millis(10)))
                .unwrap()
                .is_none()
        );
        p.unlink();
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
        assert!(
            Control::open(&name)
                .map(|_| ())
                .unwrap_err()
                .to_string()
                .contains("truncated")
        );
        p.unlink();
        assert!(matches!(
            Control::open(&name),
            Err(Error::Channel(super::super::ChannelError::NotFound(_)))
        ));
    }
    #[test]
    fn close_waits_for_frames_published_but_not_yet_received_then_withdraws_them() {
        let (p, name) = channel(2);
        let c = Control::open(&name).unwrap();
        let me = c.attach(Delivery::EveryFrame, &rel_tokens(2)).unwrap();
        for _ in 0..2 {
            let (i, _) = p.try_acquire().unwrap();
            p.publish(i, &[]).unwrap();
        }
        p.close();
        std::thread::scope(|s| {
            let drained = s.spawn(|| p.drain(Duration::from_secs(5)));
            for want in 1..=2 {
                std::thread::sleep(Duration::from_millis(20));
                let (i, seq, _) = c
                    .take(me, WaitStrategy::Block, Some(Duration::from_secs(1)))
                    .unwrap()
                    .unwrap();
                assert_eq!(seq, want);
                c.release(me, i);
            }
            assert_eq!(drained.join().unwrap(), 0, "the consumer got both frames");
        });
        let r = c.take(me, WaitStrategy::Block, Some(Duration::from_secs(1)));
        assert!(matches!(r, Err(Error::ChannelClosed)));
        p.unlink();
        // After a drain that timed out, frames left are withdrawn, never delivered from freed memory.
        let (p, name) = channel(2);
        let c = Control::open(&name).unwrap();
        let me = c.attach(Delivery::EveryFrame, &rel_tokens(2)).unwrap();
        let (i, _) = p.try_acquire().unwrap();
        p.publish(i, &[]).unwrap();
        p.close();
        assert_eq!(p.drain(Duration::from_millis(30)), 0);
        let r = c.take(me, WaitStrategy::Block, Some(Duration::from_secs(1)));
        assert!(matches!(r, Err(Error::ChannelClosed)));
        p.unlink();
    }
}
