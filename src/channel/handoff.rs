//! The hand-off protocol on the control segment ([`Control`]): the producer's side (acquire,
//! publish, abandon, the ready words, reclaiming dead consumers' holds, close and drain) and the
//! consumer's side (attach, take, release, detach), with the channel's counters. Never calls
//! CUDA: the producer and consumer types wrap it with the GPU side.

use super::control::{Control, boot_bytes, boot_words};
use super::layout::{
    ACTIVE, CLAIMING, CLOSED, Delivery, EVERY_FRAME, FREE, LATEST_ONLY, META_BYTES, META_WORDS,
    READY_PAGE, SEQ_EMPTY, WRITING, ready_offset, ready_word_offset,
};
use super::wait::{Every, SUPERSEDED_EVERY, WaitStrategy, wait_until};
use crate::error::{Error, Result};
use crate::identity::{Liveness, ProcessIdentity};
use crate::sync::{AtomicU32, Ordering, fence};
use crate::token::TOKEN_LEN;
use std::time::Duration;

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

/// A frame's metadata as copied out of its buffer slot: at most [`META_BYTES`] bytes, held inline
/// so that taking a frame allocates nothing.
#[derive(Clone, Copy)]
pub(crate) struct Metadata {
    bytes: [u8; META_BYTES],
    len: usize,
}

impl Metadata {
    /// The producer's bytes.
    pub(crate) fn as_slice(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

impl std::fmt::Debug for Metadata {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.as_slice().fmt(f)
    }
}

/// Tests compare metadata with byte strings.
impl<T: AsRef<[u8]> + ?Sized> PartialEq<T> for Metadata {
    fn eq(&self, other: &T) -> bool {
        self.as_slice() == other.as_ref()
    }
}

impl Control {
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
        wait_until(
            h.release_wake(),
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
        h.publish_wake().bump();
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
        self.header().release_wake().bump();
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
        self.header().release_wake().bump();
        forced
    }

    /// Marks the channel closed and wakes every consumer.
    pub(crate) fn close(&self) {
        // SYNC POINT: closed. Release: pairs with `is_closed`'s Acquire.
        self.header()
            .producer_state
            .store(CLOSED, Ordering::Release);
        self.header().publish_wake().bump();
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
        let _ = wait_until(
            h.release_wake(),
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
    ) -> Result<Option<(usize, u64, Metadata)>> {
        let h = self.header();
        wait_until(
            h.publish_wake(),
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

    pub(crate) fn try_take(&self, c: usize) -> Result<Option<(usize, u64, Metadata)>> {
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
                self.header().release_wake().bump();
                continue;
            }
            let len = (b.meta_len.load(Ordering::Relaxed) as usize).min(META_BYTES);
            let mut meta = Metadata {
                bytes: [0; META_BYTES],
                len,
            };
            // Only the words that hold the `len` bytes: nothing allocated, nothing read past them.
            for k in 0..len.div_ceil(8).min(META_WORDS) {
                meta.bytes[8 * k..8 * k + 8]
                    .copy_from_slice(&b.meta[k].load(Ordering::Relaxed).to_le_bytes());
            }
            s.dropped.fetch_add(seq - cursor - 1, Ordering::Relaxed);
            s.received.fetch_add(1, Ordering::Relaxed);
            // SYNC POINT: cursor. Release: pairs with the producer's Acquire of cursors in
            // `min_lossless_cursor`.
            s.cursor.store(seq, Ordering::Release);
            self.header().release_wake().bump();
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
    pub(crate) fn take_or_closed(&self, c: usize) -> Result<Option<(usize, u64, Metadata)>> {
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
        self.header().release_wake().bump();
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::channel::control::tests::{channel, rel_tokens};
    use crate::channel::wait::take_wakes;

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
    fn a_hand_off_nobody_sleeps_for_makes_no_futex_wake() {
        // Publish, take, release, abandon, a take that finds nothing: every bump of the hot
        // path, with no waiter counted, stays out of the kernel.
        let (c, _name) = channel(2);
        let slot = c.attach(Delivery::EveryFrame, &rel_tokens(2)).unwrap();
        take_wakes();
        for _ in 0..100 {
            let (i, _) = c.try_acquire().unwrap();
            c.publish(i, b"frame").unwrap();
            let (j, _, meta) = c.try_take(slot).unwrap().expect("the frame");
            assert_eq!((j, meta.as_slice()), (i, &b"frame"[..]));
            assert!(c.try_take(slot).unwrap().is_none());
            c.release(slot, j);
        }
        let (i, _) = c.try_acquire().unwrap();
        c.abandon(i);
        assert_eq!(take_wakes(), (0, 0));
        // A consumer asleep in `take` is counted: the next publish wakes it.
        std::thread::scope(|s| {
            let consumer = s.spawn(|| {
                c.take(slot, WaitStrategy::Block, Some(Duration::from_secs(10)))
                    .unwrap()
                    .expect("woken for the frame")
            });
            while c.header().publish_sleepers.load(Ordering::SeqCst) == 0 {
                std::thread::yield_now();
            }
            let (i, _) = c.try_acquire().unwrap();
            c.publish(i, b"late").unwrap();
            let (calls, _) = take_wakes();
            assert_eq!(calls, 1, "the publish did not wake the counted consumer");
            let (j, _, meta) = consumer.join().unwrap();
            assert_eq!(meta, b"late");
            c.release(slot, j);
        });
        assert_eq!(c.header().publish_sleepers.load(Ordering::SeqCst), 0);
        assert_eq!(c.header().release_sleepers.load(Ordering::SeqCst), 0);
        c.unlink();
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
        assert_eq!((s1, m1.as_slice()), (1, &1u64.to_le_bytes()[..]));
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
