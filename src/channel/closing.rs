//! The channel's close and its waits on `Control`: marking it closed ([`Control::close`]), a
//! tensor set's close that withdraws every generation as it begins
//! ([`Control::close_withdrawing`], made once), the waits for the holds and every-frame consumers
//! to settle ([`Control::wait_drained`], [`Control::wait_released`]), withdrawing what is left
//! ([`Control::drain`], [`Control::withdraw_all`]), and a writer's wait until its readers have
//! taken a frame ([`Control::wait_taken`]). The words it changes and their orderings (SYNC POINT:
//! closed, hold, release, cursor) are `handoff.rs`'s and `hold.rs`'s (`HoldWords::withdraw_frame`,
//! `HoldWords::withdraw`, with the loom models); the acquires, takes and releases whose holds these
//! waits see end are `handoff.rs`'s, which names nothing of this file. Never calls CUDA.

use super::control::{Control, boot_words};
use super::layout::{ACTIVE, CLOSED};
use super::wait::{WaitStrategy, wait_until};
use crate::identity::ProcessIdentity;
use crate::sync::Ordering;
use std::time::Duration;

impl Control {
    /// Marks the channel closed and wakes every consumer.
    pub(crate) fn close(&self) {
        if self.inherited() {
            return; // the parent's channel (`identity::fork`)
        }
        self.mark_closed();
        self.header().publish_wake().bump();
    }

    fn mark_closed(&self) {
        // SYNC POINT: closed. Release: pairs with `is_closed`'s Acquire.
        self.header()
            .producer_state
            .store(CLOSED, Ordering::Release);
    }

    /// Marks the channel closed and withdraws every frame at once, leaving the holds there
    /// (a tensor set's generation channel: its consumers take the newest frame again and again,
    /// [`Control::try_take_newer`], so they never run out of frames, and a close that let them
    /// take would wait for holds that never stop coming). Every buffer's `seq` := [`WRITING`](super::layout::WRITING)
    /// for good ([`HoldWords::withdraw_frame`]: the Dekker pair of the hold, SYNC POINT hold), so
    /// no hold is granted from here on (a consumer sees WRITING, then the channel closed:
    /// [`ChannelError::Closed`](super::ChannelError::Closed)), and every hold granted before is
    /// in `hold_mask` for the loads that follow ([`Control::wait_released`]), where they only
    /// end. A reservation is forgotten, not given back.
    /// Wakes every consumer. Returns the frame each buffer held (its reservation's, where
    /// reserved): the release words a GPU close waits for.
    ///
    /// [`HoldWords::withdraw_frame`]: super::hold::HoldWords::withdraw_frame
    pub(crate) fn close_withdrawing(&self) -> Vec<u64> {
        if self.inherited() {
            return Vec::new(); // the parent's channel (`identity::fork`)
        }
        self.withdrawn.get_or_init(|| self.withdraw_once()).clone()
    }

    /// [`Control::close_withdrawing`]'s withdrawal, made once.
    fn withdraw_once(&self) -> Vec<u64> {
        // Held to the end: a publish of this process ends before (its frame is withdrawn below)
        // or waits, then finds the withdrawal begun and publishes nothing (`Control::publish`).
        let mut withdrawing = self.withdrawing_gate();
        *withdrawing = true;
        // Held until every buffer is withdrawn: a reservation (`claim_buffer`, which makes it
        // under this lock) is either recorded already, and its frame is the one the close waits
        // for, or made after the withdrawal, and then fails (it finds `seq` WRITING).
        let mut reservation = self.reservation();
        let reserved = reservation.take();
        // Closed first: a consumer that sees a withdrawn buffer (Acquire or SeqCst on `seq`, after
        // the store below) sees the channel closed (SYNC POINT: closed), so its one more look
        // ends in `Closed` at once.
        self.mark_closed();
        let frames = (0..self.buffers)
            .map(|i| {
                let was = self.buffer(i).words().withdraw_frame();
                match reserved {
                    Some((r, seq)) if r == i => seq,
                    _ => was,
                }
            })
            .collect();
        drop(reservation);
        self.header().publish_wake().bump();
        // The producer's acquires wait on the release wake: they end in `Closed` at once.
        self.header().release_wake().bump();
        frames
    }

    /// The lock over the control's `withdrawing` flag (a panic while it was held left the flag
    /// as it was: still meaningful).
    pub(super) fn withdrawing_gate(&self) -> std::sync::MutexGuard<'_, bool> {
        self.withdrawing
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether [`Control::close_withdrawing`] has begun in this process.
    pub(crate) fn is_withdrawn(&self) -> bool {
        *self.withdrawing_gate()
    }

    /// Holds outstanding now, over all buffers, of the consumer slots not in mask `skip` (bit
    /// `c`: slot `c`; 0: every hold).
    fn outstanding_holds(&self, skip: u64) -> u32 {
        (0..self.buffers)
            .map(|i| {
                // SYNC POINT: release, hold. Acquire: pairs with the consumers' clears in
                // `release`. After `close_withdrawing`'s SeqCst fence this is the load half of the
                // producer's side of the Dekker pair: a hold that did not see the withdrawal is
                // seen here (any ordering would do after the fence).
                (self.buffer(i).hold_mask.load(Ordering::Acquire) & !skip).count_ones()
            })
            .sum()
    }

    /// The consumer slots attached by process `me` (bit `c`: slot `c`), as [`Control::attach`]
    /// recorded their identity: a process that is exiting waits for no consumer of its own
    /// ([`crate::channel::Producer::close_at_exit`]).
    pub(crate) fn consumers_of(&self, me: &ProcessIdentity) -> u64 {
        let boot = boot_words(me);
        (0..self.consumers.min(64))
            .filter(|&c| {
                let s = self.consumer(c);
                // SYNC POINT: attach. Acquire: pairs with the Release store of ACTIVE in
                // `attach`: the identity words stored before it are visible.
                s.state.load(Ordering::Acquire) == ACTIVE
                    && s.pid.load(Ordering::Relaxed) == me.pid
                    && s.pid_ns.load(Ordering::Relaxed) == me.pid_ns
                    && s.start_time.load(Ordering::Relaxed) == me.start_time
                    && s.boot_id[0].load(Ordering::Relaxed) == boot[0]
                    && s.boot_id[1].load(Ordering::Relaxed) == boot[1]
            })
            .fold(0, |m, c| m | 1 << c)
    }

    /// Waits up to `timeout` until every every-frame consumer received every published frame and
    /// no consumer holds a buffer, leaving out the consumer slots in mask `skip`; returns whether
    /// that is so.
    pub(crate) fn wait_drained(&self, timeout: Duration, skip: u64) -> bool {
        self.wait_settled(timeout, true, skip)
    }

    /// Waits up to `timeout` until no consumer outside mask `skip` holds a buffer (after
    /// [`Control::close_withdrawing`]: no frame is left to receive, and the holds only end);
    /// returns whether that is so.
    pub(crate) fn wait_released(&self, timeout: Duration, skip: u64) -> bool {
        self.wait_settled(timeout, false, skip)
    }

    /// The wait of [`Control::wait_drained`] (`cursors`) and [`Control::wait_released`].
    fn wait_settled(&self, timeout: Duration, cursors: bool, skip: u64) -> bool {
        let h = self.header();
        wait_until(
            h.release_wake(),
            WaitStrategy::Block,
            Some(timeout),
            || {
                let done = self.outstanding_holds(skip) == 0
                    && (!cursors || self.min_lossless_cursor_except(skip) >= self.head());
                Ok(done.then_some(()))
            },
            || {
                self.reclaim_dead_consumers();
                Ok(())
            },
        )
        .is_ok_and(|done| done.is_some())
    }

    /// Waits as [`Control::wait_drained`]; then withdraws every buffer and forces the holds
    /// left ([`Control::withdraw_all`]).
    pub(crate) fn drain(&self, timeout: Duration, skip: u64) -> (u64, u64) {
        self.wait_drained(timeout, skip);
        self.withdraw_all()
    }

    /// Withdraws every buffer (no consumer can take a frame after this) and forces the holds
    /// left. Returns the number of holds forced and the every-frame consumers that had not
    /// received every published frame.
    pub(crate) fn withdraw_all(&self) -> (u64, u64) {
        let h = self.header();
        let behind = self.lossless_behind();
        let mut forced = 0;
        for i in 0..self.buffers {
            forced += u64::from(self.buffer(i).words().withdraw());
        }
        if forced > 0 {
            h.forced_releases.fetch_add(forced, Ordering::Relaxed);
        }
        (forced, behind)
    }

    /// Attached consumers that have taken neither frame `seq` nor a later one (their cursor is
    /// below `seq`); a consumer that attached after `seq` was published starts at it.
    pub(crate) fn consumers_before(&self, seq: u64) -> u64 {
        (0..self.consumers)
            .filter(|&c| {
                let s = self.consumer(c);
                // SYNC POINT: attach, cursor. Acquire: as in `min_lossless_cursor`.
                s.state.load(Ordering::Acquire) == ACTIVE && s.cursor.load(Ordering::Acquire) < seq
            })
            .count() as u64
    }

    /// Waits up to `timeout` (`None`: no bound) until every attached consumer has taken frame
    /// `seq` or a later one ([`Control::consumers_before`]); a dead consumer's slot is freed on
    /// the way, so it holds nothing up. Returns whether they all have.
    pub(crate) fn wait_taken(&self, seq: u64, timeout: Option<Duration>) -> bool {
        wait_until(
            // Every take bumps it (`took`), and so does a slot freed.
            self.header().release_wake(),
            WaitStrategy::Block,
            timeout,
            || {
                // Withdrawn (a tensor set's `Closer`): no consumer takes a frame any more.
                if self.is_withdrawn() {
                    return Err(super::ChannelError::Closed.into());
                }
                Ok((self.consumers_before(seq) == 0).then_some(()))
            },
            || {
                self.reclaim_dead_consumers();
                Ok(())
            },
        )
        .is_ok_and(|done| done.is_some())
    }
}
