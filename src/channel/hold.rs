//! The hold protocol of one buffer: how a consumer holds a frame and the producer claims the
//! buffer for writing, on the words of its `BufferSlot` (`seq`, `hold_mask`, `used_mask`).
//!
//! Holding a buffer is a Dekker pair ([`HoldWords`]): the consumer sets its bit in `hold_mask` and
//! then re-reads `seq`; the producer swaps `seq` to [`WRITING`] and then re-reads `hold_mask`. Both
//! sides use `SeqCst` accesses with a `SeqCst` fence between the two, so at least one of them sees
//! the other and backs off: a buffer is never written while a consumer holds it (loom model
//! `loom_channel_*` below).

use super::layout::{BufferSlot, WRITING};
use crate::sync::{AtomicU64, Ordering, fence};

impl BufferSlot {
    /// The words of this slot that the hold protocol touches.
    pub(super) fn words(&self) -> HoldWords<'_> {
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

/// What [`HoldWords::claim_or_reserve`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Claimed {
    /// Claimed: the consumers that read the buffer since its last write.
    Now(u64),
    /// `seq` is [`WRITING`] but consumers still hold the frame: no new hold succeeds; finish
    /// with [`HoldWords::finish_reserved`] or give back with [`HoldWords::unreserve`].
    Reserved,
    /// `seq` was no longer the one read: nothing changed.
    Changed,
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
        // `claim`, `claim_or_reserve` and `withdraw`.
        let before = self.hold_mask.fetch_or(bit, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        // SYNC POINT: hold, publish. SeqCst (an acquire): a claim or reservation before the
        // fence above is seen as WRITING; a frame seen is the one published with its metadata and
        // bytes.
        if self.seq.load(Ordering::SeqCst) != seq {
            // Backed off. The bit is cleared only where this hold set it: set before, it is
            // another hold's of the same consumer (a tensor-set reader's guards share one), which
            // the producer's reservation waits for and which still reads the buffer.
            if before & bit == 0 {
                // SYNC POINT: release. SeqCst: as `release`.
                self.hold_mask.fetch_and(!bit, Ordering::SeqCst);
            }
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

    /// The producer's claim that holds new readers off, for a buffer it must have (a pool of one:
    /// without it, readers whose holds overlap would keep the buffer forever): `seq` :=
    /// [`WRITING`] from `seq` whether or not consumers hold the frame, then [`Claimed::Now`] when
    /// none does. Otherwise [`Claimed::Reserved`]: no hold succeeds from now on (a hold re-reads
    /// `seq` after setting its bit and backs off), the holds there end as they release, and
    /// [`HoldWords::finish_reserved`] completes the claim once none is left, or
    /// [`HoldWords::unreserve`] gives the frame back as it was.
    pub(crate) fn claim_or_reserve(&self, seq: u64) -> Claimed {
        // SYNC POINT: hold. SeqCst, then a SeqCst fence: the producer half of the Dekker pair with
        // `hold`, as in `claim`.
        if self
            .seq
            .compare_exchange(seq, WRITING, Ordering::SeqCst, Ordering::SeqCst)
            .is_err()
        {
            return Claimed::Changed;
        }
        fence(Ordering::SeqCst);
        self.finish_reserved()
            .map_or(Claimed::Reserved, Claimed::Now)
    }

    /// Completes a claim that [`HoldWords::claim_or_reserve`] left reserved: the consumers that
    /// read the buffer since its last write once no hold is left, else `None` (still reserved).
    pub(crate) fn finish_reserved(&self) -> Option<u64> {
        // SYNC POINT: release. SeqCst (an acquire): pairs with the consumers' clears of their bits
        // (`release`, `free_consumer_slot`), as in `claim`: a mask seen clear comes after every
        // read of the frame. No hold is added while `seq` is WRITING (the Dekker pair above).
        if self.hold_mask.load(Ordering::SeqCst) != 0 {
            return None;
        }
        // SYNC POINT: used. AcqRel: pairs with the consumers' fetch_or in `hold`.
        Some(self.used_mask.swap(0, Ordering::AcqRel))
    }

    /// Gives back a buffer reserved from frame `seq` and not claimed: the frame is takeable again,
    /// with the holds that outlived the reservation.
    pub(crate) fn unreserve(&self, seq: u64) {
        // SYNC POINT: publish. Release: given back unchanged; pairs with the Acquire loads of
        // seq (nothing was written: the frame's metadata and bytes are as published).
        self.seq.store(seq, Ordering::Release);
    }

    /// Withdraws the frame at the start of a close that turns every later hold away (a tensor
    /// set's generation channel, `Control::close_withdrawing`): `seq` := [`WRITING`] for good,
    /// the holds there left as they are. Returns the `seq` it replaced ([`WRITING`] when the
    /// buffer was claimed or reserved already). A consumer whose hold comes after this sees
    /// WRITING and backs off; one before is seen in `hold_mask` by every load the producer makes
    /// after this (the Dekker pair), so a close that waits for `hold_mask` to clear waits exactly
    /// for the holds taken before it, which only end from then on.
    pub(crate) fn withdraw_frame(&self) -> u64 {
        // SYNC POINT: hold. SeqCst, then a SeqCst fence: the producer half of the Dekker pair with
        // `hold`, as in `claim`; the caller's later loads of `hold_mask` are the other half's
        // loads (`Control::outstanding_holds`).
        let was = self.seq.swap(WRITING, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        was
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
    use crate::channel::layout::SEQ_EMPTY;
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

    /// The producer's write of frame `next` through a reservation (a pool of one buffer): claimed
    /// or reserved at once, then finished once the holds there are gone (yielding meanwhile).
    /// Returns the consumers whose release events the write waited on, or `None` when it did not
    /// write.
    fn write_reserving(b: &Buf, next: u64) -> Option<u64> {
        // SYNC POINT: publish (as in `try_acquire`).
        let seq = b.seq.load(Ordering::Acquire);
        if seq == WRITING {
            return None;
        }
        let used = match b.words().claim_or_reserve(seq) {
            Claimed::Now(used) => used,
            Claimed::Changed => return None,
            Claimed::Reserved => loop {
                if let Some(used) = b.words().finish_reserved() {
                    break used;
                }
                loom::thread::yield_now();
            },
        };
        // SAFETY: loom checks this write against every read of the model.
        b.data.with_mut(|p| unsafe { *p = next });
        // SYNC POINT: publish (as in `publish`).
        b.seq.store(next, Ordering::Release);
        Some(used)
    }

    #[test]
    fn loom_channel_a_reservation_waits_for_holds_that_share_a_bit_and_turns_new_ones_away() {
        builder().check(|| {
            let b = Buf::published();
            let c = b.clone();
            // One consumer, two takes sharing its bit (a tensor-set reader's two guards): the
            // second take while the first holds; the first's reads go on after the second's
            // attempt, whatever it found; one release ends both.
            let consumer = loom::thread::spawn(move || {
                let seq = c.seq.load(Ordering::Acquire);
                if seq == SEQ_EMPTY || seq == WRITING || !c.words().hold(1, seq) {
                    return None;
                }
                let again = c.seq.load(Ordering::Acquire);
                let second = again != WRITING && c.words().hold(1, again);
                // SAFETY: loom checks this read against every write of the model.
                let got = c.data.with(|p| unsafe { *p });
                assert_eq!(
                    got, seq,
                    "read frame {seq}'s buffer while frame {got} was in it"
                );
                c.words().release(1);
                Some((seq, second))
            });
            let used = write_reserving(&b, 2);
            let took = consumer.join().unwrap();
            if let Some((1, _)) = took {
                assert_eq!(
                    used,
                    Some(1),
                    "the write did not wait on the reader of frame 1"
                );
            }
            assert_eq!(b.hold_mask.load(Ordering::Relaxed), 0);
            assert_eq!(b.seq.load(Ordering::Relaxed), 2);
        });
    }

    #[test]
    fn loom_channel_an_unreserved_buffer_is_as_it_was() {
        builder().check(|| {
            let b = Buf::published();
            let c = b.clone();
            let consumer = loom::thread::spawn(move || take(&c, 1));
            if b.words().claim_or_reserve(1) == Claimed::Reserved {
                b.words().unreserve(1);
            } else {
                // Claimed at once (or never, were it changed): give the frame back unwritten.
                b.seq.store(1, Ordering::Release);
            }
            let took = consumer.join().unwrap();
            assert!(matches!(took, None | Some(1)));
            assert_eq!(b.seq.load(Ordering::Relaxed), 1);
            assert_eq!(b.hold_mask.load(Ordering::Relaxed), 0);
        });
    }

    #[test]
    fn loom_channel_a_close_turns_later_holds_away_and_waits_for_the_earlier() {
        builder().check(|| {
            let b = Buf::published();
            let begun = Arc::new(AtomicU64::new(0));
            // A consumer that takes the same frame again and again (a tensor-set reader's
            // `current()`), one take before and one after it may have seen the close begin.
            let (c, seen) = (b.clone(), begun.clone());
            let consumer = loom::thread::spawn(move || {
                let first = take(&c, 1);
                // Acquire: pairs with the Release store below, which stands for what the close
                // does after the withdrawal (a tensor set's names unlinked): a consumer that sees
                // it must be turned away.
                let closing = seen.load(Ordering::Acquire) == 1;
                let second = take(&c, 1);
                assert!(
                    !(closing && second.is_some()),
                    "a hold was granted after the close began"
                );
                first
            });
            // The close: withdraw the frame, say so, wait for the holds there (the loads of
            // `wait_drained`), then free the buffer (its bytes rewritten): loom fails the model on
            // a read of a hold the wait did not see.
            let was = b.words().withdraw_frame();
            assert_eq!(was, 1);
            begun.store(1, Ordering::Release);
            while b.hold_mask.load(Ordering::Acquire) != 0 {
                loom::thread::yield_now();
            }
            // SAFETY: loom checks this write against every read of the model.
            b.data.with_mut(|p| unsafe { *p = 0 });
            let first = consumer.join().unwrap();
            assert!(matches!(first, None | Some(1)));
            assert_eq!(b.seq.load(Ordering::Relaxed), WRITING);
            assert_eq!(b.hold_mask.load(Ordering::Relaxed), 0);
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
