//! The hand-off protocol on the control segment ([`Control`]): the producer's side (acquire,
//! publish, abandon, the ready words, reclaiming dead consumers' holds) and the consumer's side
//! (attach, take, release, detach); its counters are `channel::stats`', the reservation of a pool
//! of one buffer that its acquires try through is `channel::reserve`'s (`claim_buffer`,
//! `finish_reservation`, `unreserve`, `acquire_reserving`), and the close with its waits is
//! `channel::closing`'s (`close`, `close_withdrawing`, `wait_drained`, `wait_released`, `drain`,
//! `withdraw_all`, `wait_taken`). Never calls CUDA: the producer and consumer types wrap it with
//! the GPU side.

use super::control::{Control, boot_bytes, boot_words};
use super::layout::{
    ACTIVE, CLAIMING, Delivery, EVERY_FRAME, FREE, GATE_END_OFFSET, GATE_HORIZON,
    GATE_STATE_OFFSET, GPU_WORDS, GateState, LATEST_ONLY, LEAVING, MAX_BUFFERS, META_BYTES,
    META_WORDS, SEQ_EMPTY, TRANSPORT_BRIDGED, WRITING, ready_offset, ready_word_offset,
    release_word_offset,
};
use super::stats::monotonic_us32;
use super::wait::{Every, SUPERSEDED_EVERY, WaitStrategy, wait_until};
use crate::error::{Error, Result};
use crate::identity::{Liveness, ProcessIdentity};
use crate::sync::{AtomicU32, Ordering};
use std::ops::ControlFlow;
use std::sync::Mutex;
use std::time::Duration;

/// A claim of a buffer for writing: its index, the consumers that read it since its last write
/// (bit = consumer slot), and the sequence number of the frame they read there (whose release
/// words the write waits for).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Claim {
    pub(crate) index: usize,
    pub(crate) used: u64,
    pub(crate) old_seq: u64,
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
    /// received (or that holds the oldest frame; in ring order, the next buffer of the ring).
    /// Reclaims dead consumers' holds while waiting.
    pub(crate) fn acquire(
        &self,
        strategy: WaitStrategy,
        timeout: Option<Duration>,
    ) -> Result<Option<Claim>> {
        self.acquire_keeping(strategy, timeout, false)
    }

    /// [`Control::acquire`]; with `keep_newest`, never the newest frame's buffer: it waits for an
    /// older one instead.
    pub(crate) fn acquire_keeping(
        &self,
        strategy: WaitStrategy,
        timeout: Option<Duration>,
        keep_newest: bool,
    ) -> Result<Option<Claim>> {
        if keep_newest {
            // A reservation left by `acquire_reserving` is of the newest frame: not for this one.
            self.unreserve();
        }
        let got = self.acquire_waiting(strategy, timeout, keep_newest);
        // A reservation outlives no acquire: claimed, or given back here (timed out, failed).
        if !matches!(got, Ok(Some(_))) {
            self.unreserve();
        }
        got
    }

    /// The wait of [`Control::acquire_keeping`], leaving any reservation as it is (also
    /// [`Control::acquire_reserving`]'s).
    pub(super) fn acquire_waiting(
        &self,
        strategy: WaitStrategy,
        timeout: Option<Duration>,
        keep_newest: bool,
    ) -> Result<Option<Claim>> {
        self.check_fork()?;
        let h = self.header();
        wait_until(
            h.release_wake(),
            strategy,
            timeout,
            || {
                // A tensor set's `Closer` withdrew the frames: nothing is published any more.
                self.check_withdrawn()?;
                Ok(self.try_acquire_keeping(keep_newest))
            },
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

    /// [`ChannelError::Closed`](super::ChannelError::Closed) once [`Control::close_withdrawing`]
    /// has begun: no frame can be published from then on, so a producer's acquire would wait
    /// for nothing.
    fn check_withdrawn(&self) -> Result<()> {
        if self.is_withdrawn() {
            return Err(super::ChannelError::Closed.into());
        }
        Ok(())
    }

    pub(super) fn min_lossless_cursor(&self) -> u64 {
        self.min_lossless_cursor_except(0)
    }

    /// The lowest cursor of the every-frame consumers not in mask `skip` (bit `c`: slot `c`;
    /// `u64::MAX` when there is none).
    pub(super) fn min_lossless_cursor_except(&self, skip: u64) -> u64 {
        let mut min = u64::MAX;
        for c in 0..self.consumers {
            if c < 64 && skip & (1 << c) != 0 {
                continue;
            }
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

    /// Every-frame consumers that have not received every published frame (their cursor is
    /// below the head).
    pub(crate) fn lossless_behind(&self) -> u64 {
        let head = self.head();
        (0..self.consumers)
            .filter(|&c| {
                let s = self.consumer(c);
                // SYNC POINT: attach, cursor. Acquire: as in `min_lossless_cursor`.
                s.state.load(Ordering::Acquire) == ACTIVE
                    && s.policy.load(Ordering::Relaxed) == EVERY_FRAME
                    && s.cursor.load(Ordering::Acquire) < head
            })
            .count() as u64
    }

    pub(crate) fn try_acquire(&self) -> Option<Claim> {
        let got = self.try_acquire_keeping(false);
        if got.is_none() {
            self.unreserve();
        }
        got
    }

    /// [`Control::try_acquire`]; with `keep_newest`, never the buffer of the newest frame (it
    /// stays readable): `None` when only that one is free. A pool of one buffer held by consumers
    /// is left reserved (`claim_buffer`); the caller's next try completes the claim, or gives it
    /// back (`unreserve`).
    fn try_acquire_keeping(&self, keep_newest: bool) -> Option<Claim> {
        if let ControlFlow::Break(got) = self.finish_reservation() {
            return got;
        }
        let reserve = self.buffers == 1 && !keep_newest;
        let min_cursor = self.min_lossless_cursor();
        let head = self.head();
        if self.is_ring() {
            // Frame s goes to buffer (s - 1) % B: the next one to head % B.
            let i = (head % self.buffers as u64) as usize;
            // SYNC POINT: publish. Acquire: as below.
            let seq = self.buffer(i).seq.load(Ordering::Acquire);
            if seq == WRITING || seq > min_cursor || (keep_newest && seq == head && seq != 0) {
                return None;
            }
            return self.claim_buffer(i, seq, reserve);
        }
        // Oldest first, so the newest frame stays available to latest-only consumers; on the
        // stack, so that a claim allocates nothing.
        let mut order = [(0u64, 0usize); MAX_BUFFERS];
        let mut n = 0;
        for i in 0..self.buffers {
            // SYNC POINT: publish. Acquire: pairs with the Release stores of `seq` (`publish`,
            // `abandon`, a claim given back).
            let seq = self.buffer(i).seq.load(Ordering::Acquire);
            if seq != WRITING && seq <= min_cursor {
                order[n] = (seq, i);
                n += 1;
            }
        }
        let order = &mut order[..n];
        order.sort_unstable();
        for &(seq, i) in order.iter() {
            if seq == head
                && seq != 0
                && (keep_newest || (self.buffers > 1 && order_has_other(self, i, min_cursor)))
            {
                // Keep the newest frame while an older buffer is free.
                continue;
            }
            if let Some(claim) = self.claim_buffer(i, seq, reserve) {
                return Some(claim);
            }
        }
        None
    }

    /// Publishes the frame in buffer `i` (acquired before) with `meta`; returns its sequence number.
    pub(crate) fn publish(&self, i: usize, meta: &[u8]) -> Result<u64> {
        self.check_fork()?;
        if meta.len() > META_BYTES {
            return Err(Error::InvalidArgument(format!(
                "metadata is {} bytes; at most {META_BYTES}",
                meta.len()
            )));
        }
        // Held until the frame is published: a withdrawal (`Control::close_withdrawing`, from a
        // tensor set's `Closer` in another thread) comes wholly before or after it.
        let withdrawing = self.withdrawing_gate();
        if *withdrawing {
            return Err(super::ChannelError::Closed.into());
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
        b.publish_us.store(monotonic_us32(), Ordering::Relaxed);
        // Only this producer writes head, so load + store is race-free.
        let seq = h.head.load(Ordering::Relaxed) + 1;
        // SYNC POINT: publish. Release: pairs with consumers' Acquire loads of seq in `try_take`
        // (and the producer's in `try_acquire`); the metadata, and on a host channel the bytes
        // written to the buffer, are visible with it.
        b.seq.store(seq, Ordering::Release);
        // Relaxed: a hint published by the head store below (a reader checks the slot's seq).
        h.head_index.store(i as u32, Ordering::Relaxed);
        // SYNC POINT: head. Release: pairs with `head()`'s Acquire.
        h.head.store(seq, Ordering::Release);
        drop(withdrawing);
        h.publish_wake().bump();
        Ok(seq)
    }

    /// The sequence number the next [`Control::publish`] will give (only the producer calls this).
    pub(crate) fn next_seq(&self) -> u64 {
        self.header().head.load(Ordering::Relaxed) + 1
    }

    /// The GPU words: their address in this mapping (page aligned) and their length in bytes
    /// ([`GPU_WORDS`]: the ready page, then the release page), which producer and consumers
    /// register with the driver.
    ///
    /// - Ready word `i` (a `u32` at byte `4 i`) holds the low 32 bits of the sequence number of
    ///   the last frame whose write in buffer `i` finished on the producer's stream
    ///   (`cuStreamWriteValue32`); consumers' streams wait on it (`cuStreamWaitValue32`, `GEQ`,
    ///   which compares with wrap-around).
    /// - The gate words (state and end, at [`GATE_STATE_OFFSET`]) say whether the frames that
    ///   work posted ahead waited for came ([`Control::close_gate`]).
    /// - Release word (c, i) (at [`release_word_offset`]) holds the low 32 bits of the sequence
    ///   number of the last frame of buffer `i` whose reads finished on consumer `c`'s stream
    ///   (`cuStreamWriteValue32`); the producer's stream waits on it before overwriting the buffer.
    pub(crate) fn gpu_words(&self) -> (*mut u8, usize) {
        let off = ready_offset(self.buffers, self.consumers);
        // SAFETY: the segment is at least `segment_len` long (checked at create/open), so the
        // GPU words lie inside the mapping.
        (unsafe { self.seg.as_ptr().add(off) }, GPU_WORDS)
    }

    /// The `u32` at byte `off` of the GPU words.
    fn gpu_word(&self, off: usize) -> &AtomicU32 {
        assert!(off + 4 <= GPU_WORDS && off.is_multiple_of(4));
        // SAFETY: in bounds (checked above: the GPU words lie inside the mapping) and 4-byte
        // aligned (they start page aligned); shared memory is only touched through the atomic.
        unsafe { &*self.gpu_words().0.add(off).cast::<AtomicU32>() }
    }

    fn ready_word(&self, i: usize) -> &AtomicU32 {
        assert!(i < self.buffers);
        self.gpu_word(ready_word_offset(i))
    }

    /// Consumer `c`'s release word for buffer `i`.
    pub(crate) fn release_word(&self, c: usize, i: usize) -> &AtomicU32 {
        assert!(c < self.consumers && i < self.buffers);
        self.gpu_word(release_word_offset(c, i))
    }

    /// Whether consumer `c`'s release word for buffer `i` says its reads of frame `seq` finished.
    pub(crate) fn released(&self, c: usize, i: usize, seq: u64) -> bool {
        // SYNC POINT: release word. Acquire: pairs with `raise` (host) and the consumer stream's
        // `cuStreamWriteValue32` (whose write is ordered after the stream's reads of the buffer).
        let cur = self.release_word(c, i).load(Ordering::Acquire);
        (cur.wrapping_sub(seq as u32) as i32) >= 0
    }

    /// Raises consumer `c`'s release word for buffer `i` to `seq` from the host (a consumer that
    /// could not enqueue the write on its stream, after synchronising it).
    pub(crate) fn set_released(&self, c: usize, i: usize, seq: u64) {
        raise(self.release_word(c, i), seq as u32);
    }

    /// Closes the gate: the gate words say `state` and the last frame published, then every
    /// ready word is raised to [`GATE_HORIZON`] frames past it, so that every stream waiting for
    /// a frame (published or posted ahead) drains. For a consumer whose producer died
    /// ([`GateState::ProducerGone`]; the driver never completes a dead process's work, and the
    /// frames may hold partial data) and for the producer's close, once its stream drained
    /// ([`GateState::Closed`]). Work that waited can tell a frame `s` that came from one that
    /// did not: it came when the state word is 0 or `(int32)(s - end) <= 0`.
    pub(crate) fn close_gate(&self, state: GateState) {
        let head = self.head();
        let st = self.gpu_word(GATE_STATE_OFFSET);
        // The first closer's words stay (a death after a close keeps `Closed`).
        // SYNC POINT: gate. Release (the end word is stored before it; AcqRel on the CAS): pairs
        // with `gate`'s Acquire; on the GPU, the ready words raised below are stored after both,
        // so a stream that waited past a raise reads the gate's words as written here.
        if st.load(Ordering::Acquire) == GateState::Open.to_wire() {
            self.gpu_word(GATE_END_OFFSET)
                .store(head as u32, Ordering::Relaxed);
            let _ = st.compare_exchange(
                GateState::Open.to_wire(),
                state.to_wire(),
                Ordering::AcqRel,
                Ordering::Relaxed,
            );
        }
        let want = (head as u32).wrapping_add(GATE_HORIZON);
        for i in 0..self.buffers {
            raise(self.ready_word(i), want);
        }
    }

    /// The gate's words: (state, end word), see [`Control::close_gate`].
    pub(crate) fn gate(&self) -> (u32, u32) {
        // SYNC POINT: gate. Acquire: pairs with the Release CAS in `close_gate`.
        let st = self.gpu_word(GATE_STATE_OFFSET).load(Ordering::Acquire);
        (st, self.gpu_word(GATE_END_OFFSET).load(Ordering::Relaxed))
    }

    /// Closes the gate for a producer that died ([`Control::close_gate`]).
    pub(crate) fn force_ready(&self) {
        self.close_gate(GateState::ProducerGone);
    }

    /// Sets buffer `i`'s ready word from the host (the producer, when it could not enqueue the
    /// GPU-side write after publishing `seq`).
    pub(crate) fn set_ready(&self, i: usize, seq: u64) {
        raise(self.ready_word(i), seq as u32);
    }

    /// The ready word of buffer `i` as it is now (for host-ordered takes, tests and tools).
    pub(crate) fn ready_value(&self, i: usize) -> u32 {
        // SYNC POINT: ready word. Acquire: pairs with `raise` (`set_ready`, `close_gate`) and
        // the producer stream's `cuStreamWriteValue32` (whose write follows the stream's writes
        // of the buffer, behind a memory barrier).
        self.ready_word(i).load(Ordering::Acquire)
    }

    /// What buffer `i`'s ready word says of frame `seq` now, on the host: `None` while the
    /// producer's stream has not written it; `Some(true)` once written (the producer's work on
    /// the buffer is done and visible, as for a stream that waited on the word); `Some(false)`
    /// when the word was raised past it only by the gate closed for a dead producer, which says
    /// nothing of the bytes (a closed channel's gate is raised after the producer's stream
    /// drained: every frame's word was written for real first).
    pub(crate) fn frame_written(&self, i: usize, seq: u64) -> Option<bool> {
        let word = self.ready_value(i);
        if (word.wrapping_sub(seq as u32) as i32) < 0 {
            return None;
        }
        let (state, end) = self.gate();
        Some(
            !(state == GateState::ProducerGone.to_wire() && word == end.wrapping_add(GATE_HORIZON)),
        )
    }

    /// Consumers that held buffer `i` since the producer last wrote it (and clears the mask).
    pub(crate) fn take_used(&self, i: usize) -> u64 {
        // SYNC POINT: used. AcqRel: pairs with the consumers' fetch_or in `HoldWords::hold`.
        self.buffer(i).used_mask.swap(0, Ordering::AcqRel)
    }

    /// The sequence number of the frame in buffer `i` now ([`SEQ_EMPTY`], or [`WRITING`]).
    pub(crate) fn buffer_seq(&self, i: usize) -> u64 {
        // SYNC POINT: publish. Acquire: pairs with the Release stores of seq.
        self.buffer(i).seq.load(Ordering::Acquire)
    }

    /// Gives an acquired buffer back without publishing (its previous frame is gone: seq 0).
    pub(crate) fn abandon(&self, i: usize) {
        if self.inherited() {
            return; // the parent's buffer (`identity::fork`)
        }
        // SYNC POINT: publish. Release: pairs with `try_acquire`/`try_take` Acquire loads of seq.
        self.buffer(i).seq.store(SEQ_EMPTY, Ordering::Release);
        self.header().release_wake().bump();
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

    /// The effective uid recorded in consumer slot `c` beside its identity.
    pub(crate) fn consumer_uid(&self, c: usize) -> u32 {
        // Relaxed: written with the identity before the slot's ACTIVE (Release); the callers
        // Acquire-loaded the state first, or treat the value as a diagnosis.
        self.consumer(c).uid.load(Ordering::Relaxed)
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
            if self.consumer_identity(c).liveness_as(self.consumer_uid(c)) != Liveness::Dead {
                continue;
            }
            // SYNC POINT: slot leave. The state read above is only a guess: the CAS in
            // `free_consumer_slot` decides which freer (this reclaim, another process's, the
            // consumer's own detach) frees the slot.
            forced += self.free_consumer_slot(c, st);
        }
        if forced > 0 {
            self.header()
                .forced_releases
                .fetch_add(forced, Ordering::Relaxed);
        }
        forced
    }

    /// Frees consumer slot `c` found in `expected_state`: one caller wins the slot (state
    /// [`LEAVING`]), raises its release words, drops its holds and frees it; any other returns 0.
    fn free_consumer_slot(&self, c: usize, expected_state: u32) -> u64 {
        let s = self.consumer(c);
        // SYNC POINT: slot leave. AcqRel: of two freers (the consumer detaching, reclaimers in
        // other processes) one wins; only it touches the release words, so a slow loser can never
        // raise the words of the slot's next consumer.
        if s.state
            .compare_exchange(expected_state, LEAVING, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
        {
            return 0;
        }
        // Its streams' release writes will never come (it died) or already came (it drained its
        // stream before detaching): raise its words past every frame the producer's stream may
        // wait for (at most head), so that the stream never waits for good.
        let head = self.head() as u32;
        for i in 0..self.buffers {
            raise(self.release_word(c, i), head);
        }
        let bit = 1u64 << c;
        let mut forced = 0;
        for i in 0..self.buffers {
            let b = self.buffer(i);
            // SYNC POINT: release. AcqRel: pairs with the producer's loads of hold_mask in
            // `HoldWords::claim`, as the consumer's own release does.
            if b.hold_mask.fetch_and(!bit, Ordering::AcqRel) & bit != 0 {
                forced += 1;
            }
            // The producer need not wait on its release words any more.
            // SYNC POINT: used. AcqRel: as `take_used`.
            b.used_mask.fetch_and(!bit, Ordering::AcqRel);
        }
        // SYNC POINT: slot free. Release: pairs with `attach`'s CAS (Acquire) when the slot is
        // claimed again: the raises above come before the next consumer's own words.
        s.state.store(FREE, Ordering::Release);
        self.header().release_wake().bump();
        forced
    }

    // ---------------------------------------------------------------- consumer side

    /// Claims a consumer slot. Starts at the current head (frames published before attaching
    /// are not delivered).
    pub(crate) fn attach(&self, policy: Delivery) -> Result<usize> {
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
            s.pid.store(me.pid, Ordering::Relaxed);
            s.start_time.store(me.start_time, Ordering::Relaxed);
            let bw = boot_words(&me);
            s.boot_id[0].store(bw[0], Ordering::Relaxed);
            s.boot_id[1].store(bw[1], Ordering::Relaxed);
            s.pid_ns.store(me.pid_ns, Ordering::Relaxed);
            s.uid
                .store(rustix::process::geteuid().as_raw(), Ordering::Relaxed);
            s.policy.store(policy.to_wire(), Ordering::Relaxed);
            s.received.store(0, Ordering::Relaxed);
            s.dropped.store(0, Ordering::Relaxed);
            s.transport
                .store(super::layout::TRANSPORT_LOCAL, Ordering::Relaxed);
            for b in &s.latency {
                b.store(0, Ordering::Relaxed);
            }
            s.latency_sum_us.store(0, Ordering::Relaxed);
            let head = self.head();
            // Its release words start just below the head: every frame it will hold is the head
            // or later (a latest-only consumer may take the frame at the head itself), so the
            // producer's next write of a buffer this consumer held waits for the word its stream
            // writes after its reads, and a buffer it never held is not waited for (not in its
            // `used` mask). Starting at the head would count the frame at the head as released
            // the moment the host hold is dropped, with the consumer's kernels still reading it.
            for i in 0..self.buffers {
                // SYNC POINT: release word. Relaxed: published by the Release store of ACTIVE
                // below (the producer reads a consumer's words only for frames it held).
                self.release_word(c, i)
                    .store(initial_release_word(head), Ordering::Relaxed);
            }
            s.cursor.store(head, Ordering::Relaxed);
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
        if self.inherited() {
            return; // the parent's slot (`identity::fork`)
        }
        self.free_consumer_slot(c, ACTIVE);
    }

    /// Whether the producer is gone: closed, or its process dead.
    pub(crate) fn producer_gone(&self) -> Result<()> {
        let p = self.producer();
        if self.producer_liveness() == Liveness::Dead {
            return Err(Error::Channel(super::ChannelError::ProducerGone {
                pid: p.pid,
            }));
        }
        Ok(())
    }

    /// Takes the next frame for consumer `c` (by its policy), holding its buffer. Returns
    /// (buffer index, sequence number, metadata) or `None` at the timeout. Each attempt runs with
    /// `serial` held (the consumer's: see [`Control::take_or_closed`]); the wait between attempts
    /// does not hold it.
    ///
    /// # Errors
    /// [`super::ChannelError::ProducerGone`] when the producer died;
    /// [`super::ChannelError::Closed`] when it closed and
    /// no frame is left for this consumer.
    pub(crate) fn take(
        &self,
        c: usize,
        strategy: WaitStrategy,
        timeout: Option<Duration>,
        serial: &Mutex<()>,
    ) -> Result<Option<(usize, u64, Metadata)>> {
        let h = self.header();
        wait_until(
            h.publish_wake(),
            strategy,
            timeout,
            || {
                let _one = serial.lock().unwrap_or_else(|p| p.into_inner());
                self.take_or_closed(c)
            },
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
        self.try_take_from(c, None)
    }

    /// Takes the newest frame for consumer `c` if its sequence number is above `than`, whatever
    /// the consumer's cursor says (it may take a frame it took before: a tensor set's reader
    /// asking for the current generation again). The hold and its re-check are `try_take`'s; the
    /// cursor only moves forward.
    pub(crate) fn try_take_newer(
        &self,
        c: usize,
        than: u64,
    ) -> Result<Option<(usize, u64, Metadata)>> {
        self.try_take_from(c, Some(than))
    }

    /// `try_take` from the consumer's cursor (`None`) or, latest-only, from `than` (`Some`).
    fn try_take_from(&self, c: usize, than: Option<u64>) -> Result<Option<(usize, u64, Metadata)>> {
        self.check_fork()?;
        let s = self.consumer(c);
        // SYNC POINT: attach. Acquire: pairs with the Release store of ACTIVE in `attach`.
        if s.state.load(Ordering::Acquire) != ACTIVE {
            return Err(Error::Channel(super::ChannelError::Detached));
        }
        let latest = than.is_some() || s.policy.load(Ordering::Relaxed) == LATEST_ONLY;
        let bit = 1u64 << c;
        let mut retries = 0;
        loop {
            let head = self.head();
            let own_cursor = s.cursor.load(Ordering::Relaxed);
            let cursor = than.unwrap_or(own_cursor);
            if head <= cursor {
                return Ok(None);
            }
            // Every-frame: the next one; if it is gone (only possible before this consumer was
            // counted, at attach), the oldest still present. Latest-only: the newest.
            let want = if latest { head } else { cursor + 1 };
            let mut found = None;
            let mut held = None;
            let mut oldest: Option<(u64, usize)> = None;
            if want == head {
                // The newest frame: its buffer is named on head's cache line, so only that slot is
                // touched (a consumer that keeps up never reads the others), and the hold itself
                // is the first access (one transfer of the slot's line). Relaxed: a hint; the hold
                // re-reads the slot's seq and backs off when it is another frame.
                let i = self.header().head_index.load(Ordering::Relaxed) as usize;
                if i < self.buffers {
                    if self.buffer(i).words().hold(bit, want) {
                        held = Some(i);
                    } else {
                        // A stale hint, or the producer took it: a claim our passing hold turned
                        // away looks again when woken.
                        self.header().release_wake().bump();
                    }
                }
            }
            if held.is_none() {
                for i in 0..self.buffers {
                    // SYNC POINT: publish. Acquire: pairs with the Release store of seq in
                    // `publish`.
                    let seq = self.buffer(i).seq.load(Ordering::Acquire);
                    if seq == want {
                        found = Some(i);
                    }
                    if seq != WRITING && seq > cursor && oldest.is_none_or(|(o, _)| seq < o) {
                        oldest = Some((seq, i));
                    }
                }
            }
            let (seq, i) = match (held, found, oldest) {
                (Some(i), _, _) => (want, i),
                (None, Some(i), _) => (want, i),
                (None, None, Some(o)) if !latest => o,
                // The producer published a newer frame since `head` was read and took the
                // wanted frame's buffer for the next (a writer committing back to back): the
                // newer one is there to take, so look again, a bounded number of times.
                _ if self.head() != head && retries < HEAD_MOVED_RETRIES => {
                    retries += 1;
                    continue;
                }
                // The wanted frame is being overwritten (a pool of one buffer) or not visible
                // yet: nothing to take now; the caller waits for the next publish.
                _ => return Ok(None),
            };
            let b = self.buffer(i);
            if held.is_none() && !b.words().hold(bit, seq) {
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
            // The slot's counters have one writer, this consumer's one take at a time (its
            // lock, `take_or_closed`): load and store. Relaxed: counters, read by inspection
            // only.
            if seq > own_cursor + 1 {
                s.dropped.store(
                    s.dropped.load(Ordering::Relaxed) + (seq - own_cursor - 1),
                    Ordering::Relaxed,
                );
            }
            s.received
                .store(s.received.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
            self.record_latency(c, b.publish_us.load(Ordering::Relaxed));
            // SYNC POINT: cursor. Release: pairs with the producer's Acquire of cursors in
            // `min_lossless_cursor`.
            s.cursor.store(seq.max(own_cursor), Ordering::Release);
            // No bump here: the caller announces the move (`took`) once it has done what the
            // hand-off waits for (the consumer's stream wait), off the hand-off's path.
            return Ok(Some((i, seq, meta)));
        }
    }

    /// [`Control::try_take`], or [`ChannelError::Closed`](super::ChannelError::Closed) when nothing is left for consumer `c` and
    /// the producer closed the channel.
    ///
    /// One take of consumer `c` at a time: the caller holds the consumer's lock (its `taking`,
    /// through [`Control::take`]'s `serial`). A take loads the slot's cursor and stores it moved,
    /// and its hold of a buffer is one bit per consumer, so two takes of one consumer at once
    /// (receives from two threads) would both take the same frame and share that bit: the
    /// first release would let the producer rewrite the buffer under the other's reads.
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
            None => Err(Error::Channel(super::ChannelError::Closed)),
        }
    }

    /// Announces that a consumer took a frame (its cursor moved): wakes a producer waiting for
    /// every-frame consumers' cursors. Every take is followed by this or by a `release`, which
    /// announces as well.
    pub(crate) fn took(&self) {
        self.header().release_wake().bump();
    }

    /// Marks the channel as filled by a bridge from another host ([`TRANSPORT_BRIDGED`] in the
    /// header's `transport` word).
    pub(crate) fn set_bridged(&self) {
        // Relaxed: a diagnostic word read by inspection only.
        self.header()
            .transport
            .store(TRANSPORT_BRIDGED, Ordering::Relaxed);
    }

    /// Marks consumer `c` as a bridge sending its frames to another host.
    pub(crate) fn set_consumer_bridged(&self, c: usize) {
        // Relaxed: as above.
        self.consumer(c)
            .transport
            .store(TRANSPORT_BRIDGED, Ordering::Relaxed);
    }

    /// Consumer `c`'s cursor: the last sequence number it received or skipped.
    pub(crate) fn cursor(&self, c: usize) -> u64 {
        // Relaxed: the consumer's own cursor, read by the consumer (its own stores).
        self.consumer(c).cursor.load(Ordering::Relaxed)
    }

    /// Whether consumer slot `c` holds an attached consumer.
    pub(crate) fn is_attached(&self, c: usize) -> bool {
        // SYNC POINT: attach. Acquire: pairs with the Release store of ACTIVE in `attach`.
        self.consumer(c).state.load(Ordering::Acquire) == ACTIVE
    }

    /// Consumer `c`'s policy code.
    pub(crate) fn policy(&self, c: usize) -> u32 {
        self.consumer(c).policy.load(Ordering::Relaxed)
    }

    /// Changes consumer `c`'s policy (a consumer leaving with receives posted ahead stops holding
    /// the producer back).
    pub(crate) fn set_policy(&self, c: usize, d: Delivery) {
        // SYNC POINT: cursor. Release: pairs with the producer's loads in `min_lossless_cursor`
        // (a latest-only consumer's cursor no longer holds it back).
        self.consumer(c)
            .policy
            .store(d.to_wire(), Ordering::Release);
        self.header().release_wake().bump();
    }

    /// Ends consumer `c`'s hold on buffer `i` (after the write of its release word was enqueued
    /// on its stream).
    pub(crate) fn release(&self, c: usize, i: usize) {
        if self.inherited() {
            return; // the parent's hold (`identity::fork`)
        }
        self.buffer(i).words().release(1u64 << c);
        self.header().release_wake().bump();
    }
}

/// Raises `w` to `want` unless it is already there or past it (the words compare with
/// wrap-around, as the GPU's `GEQ` waits do): never lowers what another writer set.
/// A consumer's release words when it attaches at `head`: one below the head's low 32 bits, so
/// that no frame it may take (the head or later) reads as released before it writes the word.
/// How many times one take looks again when the frame it wanted was replaced by a newer one
/// meanwhile (`try_take_from`): a producer that publishes faster than a take can look could
/// otherwise keep it looking; past this it says "nothing now" and the caller waits or asks again.
const HEAD_MOVED_RETRIES: u32 = 64;

fn initial_release_word(head: u64) -> u32 {
    (head as u32).wrapping_sub(1)
}

fn raise(w: &AtomicU32, want: u32) {
    let mut cur = w.load(Ordering::Relaxed);
    // SYNC POINT: ready word, release word. AcqRel: pairs with the Acquire loads of the words
    // (`ready_value`, `released`) and other raisers; on the GPU, with the streams'
    // `cuStreamWaitValue32` (a raise is what lets a waiting stream go).
    while (want.wrapping_sub(cur) as i32) > 0 {
        match w.compare_exchange_weak(cur, want, Ordering::AcqRel, Ordering::Relaxed) {
            Ok(_) => break,
            Err(c) => cur = c,
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
mod tests;
