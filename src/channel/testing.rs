//! Protocol-only access to a channel's control segment, without a GPU: for tests of tools that read
//! or drive the segment (the `cuda-ipc` command line, the Python consumer). The tokens given here
//! are stored as they are and never opened. Not part of the stable API.

use super::control::Control;
use super::{ChannelStats, Delivery, WaitStrategy};
use crate::error::Result;
use crate::shm::SegmentOptions;
use crate::token::TOKEN_LEN;
use std::time::Duration;

/// The producer's side of the protocol.
pub struct ControlProducer(Control);

impl ControlProducer {
    /// Creates the segment `cuda-ipc.ch.NAME`; `tokens[i]` = (memory token, reserved area) of
    /// buffer `i`, stored as given. The reserved area held the producer's event token in
    /// layout version 1; since version 2 producers write zeros there and nothing reads it
    /// (readiness travels through the ready page).
    ///
    /// # Errors
    /// As `Producer::create`, without the CUDA ones.
    pub fn create(
        name: &str,
        buffer_bytes: u64,
        max_consumers: usize,
        tokens: &[([u8; TOKEN_LEN], [u8; TOKEN_LEN])],
    ) -> Result<Self> {
        Control::create(
            name,
            buffer_bytes,
            max_consumers,
            tokens,
            &SegmentOptions::new(),
        )
        .map(Self)
    }
    /// A free buffer now: (index, mask of consumers that read it since its last write).
    pub fn try_acquire(&self) -> Option<(usize, u64)> {
        self.0.try_acquire()
    }
    /// Waits up to `timeout` for a free buffer (`Ok(None)` on timeout).
    ///
    /// # Errors
    /// As `Producer::acquire`.
    pub fn acquire(&self, timeout: Option<Duration>) -> Result<Option<(usize, u64)>> {
        self.0.acquire(WaitStrategy::Block, timeout)
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
    /// Consumer `c`'s release-event tokens and their generation, if it is attached.
    pub fn consumer_release_tokens(&self, c: usize) -> Option<(u64, Vec<[u8; TOKEN_LEN]>)> {
        self.0.consumer_release_tokens(c)
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
        self.0.drain(timeout)
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
        let (p, _) = self.0.ready_page();
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
}

impl ControlConsumer {
    /// Opens channel `name` and claims a consumer slot with these release-event tokens.
    ///
    /// # Errors
    /// As `Consumer::attach`, without the CUDA ones.
    pub fn attach(
        name: &str,
        delivery: Delivery,
        release_tokens: &[[u8; TOKEN_LEN]],
    ) -> Result<Self> {
        let control = Control::open(name)?;
        let slot = control.attach(delivery, release_tokens)?;
        Ok(Self { control, slot })
    }
    /// The consumer slot index.
    pub fn slot(&self) -> usize {
        self.slot
    }
    /// The memory token of buffer `i` and its reserved second token area (zero since layout
    /// version 2; kept for the byte layout, meaningless to readers).
    pub fn buffer_tokens(&self, i: usize) -> ([u8; TOKEN_LEN], [u8; TOKEN_LEN]) {
        self.control.buffer_tokens(i)
    }
    /// Waits up to `timeout` for the next frame: (buffer index, sequence number, metadata).
    ///
    /// # Errors
    /// As `Consumer::recv_timeout`.
    pub fn take(&self, timeout: Option<Duration>) -> Result<Option<(usize, u64, Vec<u8>)>> {
        Ok(self
            .control
            .take(self.slot, WaitStrategy::Block, timeout)?
            .map(|(i, seq, m)| (i, seq, m.as_slice().to_vec())))
    }
    /// Ends the hold on buffer `i`.
    pub fn release(&self, i: usize) {
        self.control.release(self.slot, i)
    }
}

impl ControlConsumer {
    /// Opens channel `name` as a consumer does, but waits at most `init_wait` for the init
    /// stamp of an unfinished segment (a consumer waits 2 s), and claims a consumer slot with
    /// zero release tokens, one per buffer (as a host channel's consumer does). For fuzzing:
    /// the segment may hold any bytes.
    ///
    /// # Errors
    /// As [`ControlConsumer::attach`].
    pub fn attach_waiting(name: &str, delivery: Delivery, init_wait: Duration) -> Result<Self> {
        let control = Control::open_waiting(name, false, init_wait)?;
        let tokens = vec![[0u8; TOKEN_LEN]; control.buffers()];
        let slot = control.attach(delivery, &tokens)?;
        Ok(Self { control, slot })
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
        Ok(self
            .control
            .take_or_closed(self.slot)?
            .map(|(i, seq, m)| (i, seq, m.as_slice().to_vec())))
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
