//! Protocol-only access to a channel's control segment, without a GPU: for tests of tools that read
//! or drive the segment (the `cuda-ipc` command line, the Python consumer). The tokens given here
//! are stored as they are and never opened. Not part of the stable API.

use super::control::Control;
use super::{ChannelStats, Delivery, WaitStrategy};
use crate::driver::Uuid;
use crate::error::Result;
use crate::identity::ProcessIdentity;
use crate::shm::SegmentOptions;
use crate::token::{TOKEN_LEN, Token, TokenKind};
use std::time::Duration;

/// A buffer's memory token for tests, stored as given and never opened: a legacy handle of 64
/// bytes `i` over 4096 bytes of a made-up device (UUID bytes 7), exported by this process.
///
/// # Errors
/// As [`ProcessIdentity::current`].
pub fn token(i: u8) -> Result<[u8; TOKEN_LEN]> {
    Ok(Token {
        kind: TokenKind::LegacyMemory,
        handle: [i; 64],
        offset: 0,
        len: 4096,
        device: Uuid([7; 16]),
        exporter: ProcessIdentity::current()?,
        export_id: 0,
    }
    .to_bytes())
}

/// The producer's side of the protocol.
pub struct ControlProducer(Control);

impl ControlProducer {
    /// Creates the segment `cuda-ipc.ch.NAME`; `tokens[i]` is the memory token of buffer `i`,
    /// stored as given.
    ///
    /// # Errors
    /// As `Producer::create`, without the CUDA ones.
    pub fn create(
        name: &str,
        buffer_bytes: u64,
        max_consumers: usize,
        tokens: &[[u8; TOKEN_LEN]],
    ) -> Result<Self> {
        Self::create_with(name, buffer_bytes, max_consumers, tokens, false)
    }
    /// [`ControlProducer::create`], in ring order when `ring` (`ChannelOptions::ring`).
    ///
    /// # Errors
    /// As [`ControlProducer::create`].
    pub fn create_with(
        name: &str,
        buffer_bytes: u64,
        max_consumers: usize,
        tokens: &[[u8; TOKEN_LEN]],
        ring: bool,
    ) -> Result<Self> {
        let flags = if ring { super::layout::FLAG_RING } else { 0 };
        Control::create_with_flags(
            name,
            buffer_bytes,
            max_consumers,
            tokens,
            flags,
            &SegmentOptions::new(),
        )
        .map(Self)
    }
    /// A free buffer now: (index, mask of consumers that read it since its last write).
    pub fn try_acquire(&self) -> Option<(usize, u64)> {
        self.0.try_acquire().map(|c| (c.index, c.used))
    }
    /// Waits up to `timeout` for a free buffer (`Ok(None)` on timeout).
    ///
    /// # Errors
    /// As `Producer::acquire`.
    pub fn acquire(&self, timeout: Option<Duration>) -> Result<Option<(usize, u64)>> {
        Ok(self
            .0
            .acquire(WaitStrategy::Block, timeout)?
            .map(|c| (c.index, c.used)))
    }
    /// Publishes buffer `i` with `meta`; returns its sequence number.
    ///
    /// # Errors
    /// As `WriteFrame::publish`.
    pub fn publish(&self, i: usize, meta: &[u8]) -> Result<u64> {
        self.0.publish(i, meta)
    }
    /// Gives buffer `i` back unpublished.
    pub fn abandon(&self, i: usize) {
        self.0.abandon(i)
    }
    /// Consumer `c`'s release word for buffer `i` (what its stream wrote last, or what was
    /// raised for it).
    pub fn release_word(&self, c: usize, i: usize) -> u32 {
        // SYNC POINT: release word. Acquire: pairs with the raises and the streams' writes.
        self.0
            .release_word(c, i)
            .load(crate::sync::Ordering::Acquire)
    }
    /// The gate's words: (state code, end word).
    pub fn gate(&self) -> (u32, u32) {
        self.0.gate()
    }
    /// Closes the gate as the producer's close does once its stream drained.
    pub fn close_gate(&self) {
        self.0.close_gate(super::layout::GateState::Closed)
    }
    /// Releases the holds of dead consumers; returns how many.
    pub fn reclaim_dead_consumers(&self) -> u64 {
        self.0.reclaim_dead_consumers()
    }
    /// Marks the channel closed.
    pub fn close(&self) {
        self.0.close()
    }
    /// Waits up to `timeout` for outstanding holds; returns how many were forced.
    pub fn drain(&self, timeout: Duration) -> u64 {
        self.0.drain(timeout, 0).0
    }
    /// Removes the segment's name.
    pub fn unlink(&self) {
        self.0.unlink()
    }
    /// Counters.
    pub fn stats(&self) -> ChannelStats {
        self.0.stats()
    }
    /// The sequence number the next publish gives.
    pub fn next_seq(&self) -> u64 {
        self.0.next_seq()
    }
    /// Sets buffer `i`'s ready word, as the producer's GPU stream does after its write.
    pub fn set_ready(&self, i: usize, value: u32) {
        let (p, _) = self.0.gpu_words();
        assert!(i < self.0.buffers());
        // SAFETY: word `i` of the ready page lies in the mapping and is 4-byte aligned; shared
        // words are only accessed atomically.
        let w = unsafe {
            &*p.add(super::layout::ready_word_offset(i))
                .cast::<std::sync::atomic::AtomicU32>()
        };
        // SYNC POINT: ready word. Release: pairs with `ready_value`'s Acquire load.
        w.store(value, std::sync::atomic::Ordering::Release);
    }
    /// Buffer `i`'s ready word.
    pub fn ready_value(&self, i: usize) -> u32 {
        self.0.ready_value(i)
    }
}

/// A consumer's side of the protocol.
pub struct ControlConsumer {
    control: Control,
    slot: usize,
    /// The consumer's lock around each take (`Consumer`'s `taking`).
    taking: std::sync::Mutex<()>,
}

impl ControlConsumer {
    /// Opens channel `name` and claims a consumer slot.
    ///
    /// # Errors
    /// As `Consumer::attach`, without the CUDA ones.
    pub fn attach(name: &str, delivery: Delivery) -> Result<Self> {
        let control = Control::open(name)?;
        let slot = control.attach(delivery)?;
        Ok(Self {
            control,
            slot,
            taking: std::sync::Mutex::new(()),
        })
    }
    /// The consumer slot index.
    pub fn slot(&self) -> usize {
        self.slot
    }
    /// The memory token of buffer `i`.
    pub fn buffer_token(&self, i: usize) -> [u8; TOKEN_LEN] {
        self.control.buffer_token(i)
    }
    /// Counts one hand-off of a frame published at `publish_us` (`CLOCK_MONOTONIC` µs, low 32 bits)
    /// in this consumer's latency histogram, exactly as every take does: for the benchmark of its
    /// cost (`bench/benches/handoff_cost.rs`).
    #[inline]
    pub fn record_latency(&self, publish_us: u32) {
        self.control.record_latency(self.slot, publish_us)
    }
    /// `CLOCK_MONOTONIC` now, µs, low 32 bits: the clock the histogram's latencies are read with.
    #[inline]
    pub fn monotonic_us32() -> u32 {
        super::stats::monotonic_us32()
    }
    /// Writes this consumer's release word for buffer `i` as its stream does after its reads of
    /// frame `seq`.
    pub fn set_released(&self, i: usize, seq: u64) {
        self.control.set_released(self.slot, i, seq)
    }
    /// Waits up to `timeout` for the next frame: (buffer index, sequence number, metadata).
    ///
    /// # Errors
    /// As `Consumer::recv_timeout`.
    pub fn take(&self, timeout: Option<Duration>) -> Result<Option<(usize, u64, Vec<u8>)>> {
        let got = self
            .control
            .take(self.slot, WaitStrategy::Block, timeout, &self.taking)?;
        self.control.took();
        Ok(got.map(|(i, seq, m)| (i, seq, m.as_slice().to_vec())))
    }
    /// Ends the hold on buffer `i`.
    pub fn release(&self, i: usize) {
        self.control.release(self.slot, i)
    }
}

impl ControlConsumer {
    /// Opens channel `name` as a consumer does, but waits at most `init_wait` for the init
    /// stamp of an unfinished segment (a consumer waits 2 s), and claims a consumer slot with
    /// as a host channel's consumer does. For fuzzing:
    /// the segment may hold any bytes.
    ///
    /// # Errors
    /// As [`ControlConsumer::attach`].
    pub fn attach_waiting(name: &str, delivery: Delivery, init_wait: Duration) -> Result<Self> {
        let control = Control::open_waiting(name, false, init_wait)?;
        let slot = control.attach(delivery)?;
        Ok(Self {
            control,
            slot,
            taking: std::sync::Mutex::new(()),
        })
    }
    /// Buffers in the pool.
    pub fn buffers(&self) -> usize {
        self.control.buffers()
    }
    /// The next frame if there is one now: (buffer index, sequence number, metadata).
    ///
    /// # Errors
    /// As `Consumer::try_recv`.
    pub fn try_take(&self) -> Result<Option<(usize, u64, Vec<u8>)>> {
        let got = {
            let _one = self.taking.lock().unwrap_or_else(|p| p.into_inner());
            self.control.take_or_closed(self.slot)?
        };
        self.control.took();
        Ok(got.map(|(i, seq, m)| (i, seq, m.as_slice().to_vec())))
    }
    /// A snapshot of the channel ([`super::inspect::inspect`]), from this consumer's mapping.
    pub fn inspect(&self, name: &str) -> super::inspect::ChannelSnapshot {
        super::inspect::snapshot(name, &self.control)
    }
}

/// [`super::inspect::inspect`], waiting at most `init_wait` for the init stamp of an
/// unfinished segment (it waits 2 s). For fuzzing.
///
/// # Errors
/// As [`super::inspect::inspect`].
pub fn inspect_waiting(name: &str, init_wait: Duration) -> Result<super::inspect::ChannelSnapshot> {
    let c = Control::open_waiting(name, false, init_wait)?;
    Ok(super::inspect::snapshot(name, &c))
}

impl Drop for ControlConsumer {
    fn drop(&mut self) {
        self.control.detach(self.slot);
    }
}
