//! The producer's reservation of a pool of one buffer (docs/decisions.md, "A pool of one buffer is
//! reserved from readers while its producer waits for it"; docs/channel-layout.md, "Reserve"):
//! when the only buffer is held, the producer stores `seq := WRITING` whatever the holds, the same
//! Dekker pair as a claim's then turns every new hold away, and the claim completes at a later try
//! once the holds there have ended; an acquire that times out or fails gives the frame back.
//!
//! This file holds `Control`'s side of it: the claim that reserves ([`Control::claim_buffer`]),
//! the first step of each try that completes a reservation ([`Control::finish_reservation`]), the
//! acquire that keeps the reservation across its timeout for callers waiting in slices
//! ([`Control::acquire_reserving`]), and giving the frame back ([`Control::unreserve`]). The
//! words it changes and their orderings (SYNC POINT: hold, release, used, publish) are
//! `hold.rs`'s (`HoldWords::claim_or_reserve`, `finish_reserved`, `unreserve`, with the loom
//! models); the process-local record of the reservation is `Control::reserved` (`control.rs`);
//! the acquires that try through it are `handoff.rs`'s, which names nothing of this file. Never
//! calls CUDA.

use super::control::Control;
use super::handoff::Claim;
use super::hold::Claimed;
use super::wait::WaitStrategy;
use crate::error::Result;
use std::ops::ControlFlow;
use std::sync::MutexGuard;
use std::time::Duration;

impl Control {
    /// [`Control::acquire`], but a timeout (`Ok(None)`) leaves a reservation in place
    /// (`claim_buffer`): the next acquire of this producer goes on waiting for the same holds,
    /// with no new hold taken meanwhile. For callers that wait in slices (a binding checking for
    /// signals between them), which give the reservation back (`unreserve`) when they stop
    /// waiting; an error gives it back here.
    pub(crate) fn acquire_reserving(
        &self,
        strategy: WaitStrategy,
        timeout: Option<Duration>,
    ) -> Result<Option<Claim>> {
        let got = self.acquire_waiting(strategy, timeout, false);
        if got.is_err() {
            self.unreserve();
        }
        got
    }

    /// Gives back the buffer this producer reserved and did not claim (`claim_buffer`): its
    /// frame is takeable again, and consumers that backed off look again. Nothing when there is
    /// no reservation.
    pub(crate) fn unreserve(&self) {
        if self.inherited() {
            return; // the parent's reservation (`identity::fork`)
        }
        let taken = self
            .reserved
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some((i, seq)) = taken {
            self.buffer(i).words().unreserve(seq);
            self.header().publish_wake().bump();
        }
    }

    /// The lock of this producer's reservation (buffer, the frame reserved there), for a close
    /// that withdraws every frame (`close_withdrawing`): it takes the reservation without giving
    /// the frame back, and holds the lock while it withdraws, so that no reservation is made
    /// between the two ([`Control::claim_buffer`] reserves under it).
    pub(super) fn reservation(&self) -> MutexGuard<'_, Option<(usize, u64)>> {
        self.reserved.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The frame in buffer `i` as a close sees it: the one this producer's reservation keeps
    /// there (its `seq` is [`WRITING`](super::layout::WRITING) meanwhile, and its consumers'
    /// release words are those of that frame), else [`Control::buffer_seq`].
    pub(super) fn frame_in(&self, i: usize) -> u64 {
        match *self.reserved.lock().unwrap_or_else(|p| p.into_inner()) {
            Some((r, seq)) if r == i => seq,
            _ => self.buffer_seq(i),
        }
    }

    /// The first step of a try to acquire (`try_acquire_keeping`), under one lock of the
    /// reservation: with a buffer reserved, the try ends here (`Break`) with the claim completed
    /// once no hold is left there ([`HoldWords::finish_reserved`]), or with `None` while holds
    /// remain (it stays reserved); with none, the try goes on to look for a buffer (`Continue`).
    ///
    /// [`HoldWords::finish_reserved`]: super::hold::HoldWords::finish_reserved
    pub(super) fn finish_reservation(&self) -> ControlFlow<Option<Claim>> {
        let mut reserved = self.reserved.lock().unwrap_or_else(|p| p.into_inner());
        let Some((i, seq)) = *reserved else {
            return ControlFlow::Continue(());
        };
        let Some(used) = self.buffer(i).words().finish_reserved() else {
            return ControlFlow::Break(None);
        };
        *reserved = None;
        ControlFlow::Break(Some(Claim {
            index: i,
            used,
            old_seq: seq,
        }))
    }

    /// Claims buffer `i`, whose frame the producer read as `seq`. A pool of one buffer (the only
    /// one to be had, as an in-place tensor set's) is reserved when held
    /// ([`HoldWords::claim_or_reserve`](super::hold::HoldWords::claim_or_reserve)):
    /// no new hold is taken meanwhile, so readers whose holds overlap without pause cannot keep
    /// it from the producer; the claim completes at a later try once the holds there are gone.
    /// Any other buffer is claimed only while nobody holds it.
    pub(super) fn claim_buffer(&self, i: usize, seq: u64, reserve: bool) -> Option<Claim> {
        let claim = |used| Claim {
            index: i,
            used,
            old_seq: seq,
        };
        if !reserve {
            return self.buffer(i).words().claim(seq).map(claim);
        }
        // Under the reservation's lock from the claim to its record: a close's withdrawal
        // (`close_withdrawing`, under the same lock) sees the reservation made, or comes first
        // and makes the claim fail.
        let mut reserved = self.reservation();
        match self.buffer(i).words().claim_or_reserve(seq) {
            Claimed::Now(used) => Some(claim(used)),
            Claimed::Reserved => {
                #[cfg(test)]
                if let Some(hook) = tests::AFTER_RESERVING.get() {
                    hook();
                }
                *reserved = Some((i, seq));
                None
            }
            Claimed::Changed => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::channel::control::tests::channel;
    use crate::channel::layout::Delivery;
    use std::cell::Cell;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    thread_local! {
        /// Run on this thread by `claim_buffer` between a reservation's claim (`seq` := WRITING)
        /// and its record.
        pub(super) static AFTER_RESERVING: Cell<Option<fn()>> = const { Cell::new(None) };
    }

    static RESERVING: AtomicBool = AtomicBool::new(false);

    /// The claim is made: let the close begin, and give it time to finish if it can.
    fn let_the_close_in() {
        RESERVING.store(true, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(150));
    }

    #[test]
    fn a_close_withdrawing_while_a_reservation_is_made_waits_for_the_reserved_frame() {
        // A pool of one buffer whose frame a consumer holds: the producer's claim reserves it.
        // A close that withdraws between the claim and its record (a tensor set's `Closer` in
        // another thread while `begin` claims) must still return the reserved frame, whose
        // consumers' release words a GPU close waits for; it read WRITING before.
        let (c, _name) = channel(1);
        let slot = c.attach(Delivery::LatestOnly).unwrap();
        let claim = c.try_acquire().expect("the free buffer");
        let seq = c.publish(claim.index, b"held").unwrap();
        let (i, _, _) = c.try_take(slot).unwrap().expect("the frame");
        std::thread::scope(|s| {
            let producer = s.spawn(|| {
                AFTER_RESERVING.set(Some(let_the_close_in));
                c.try_acquire()
            });
            while !RESERVING.load(Ordering::SeqCst) {
                std::thread::yield_now();
            }
            assert_eq!(c.close_withdrawing(), vec![seq]);
            assert!(
                producer.join().unwrap().is_none(),
                "the buffer is still held"
            );
        });
        c.release(slot, i);
        c.unlink();
    }
}
