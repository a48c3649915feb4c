//! The slot protocol: the writer lock word, the seqlock around the payload, and recovery of a slot
//! whose writer died. Written against plain references to atomics so the loom model below runs the
//! same code on heap memory that the registry runs on the mapped segment.
//!
//! A slot is in one of these states (see docs/registry-layout.md):
//!
//! | writer | seq | payload state | meaning |
//! | --- | --- | --- | --- |
//! | 0 | even | FREE | free |
//! | name | even | any | locked by a writer that has not opened (or has closed) its write |
//! | name | odd | any | writing: readers retry, then skip |
//! | 0 | even | PUBLISHED | published |
//! | name of a dead process | any | any | abandoned: the next locker takes it over; if seq was odd the half-written record is dropped (slot freed) |
//!
//! Lock words hold *lock names* (see `Participant` in the layout): a name leads to the holder's
//! participant entry and full identity, so whether a holder is dead is decided by
//! [`crate::identity::ProcessIdentity::liveness`], right across pid namespaces.

use super::layout::{PAYLOAD_WORDS, STATE_FREE, W_STATE};
use crate::shm::SeqLock;
use crate::shm::ShmError;
use crate::sync::{AtomicU64, Ordering};

/// Points in a write or a repair where a test hook may stop the process (a test's child pauses
/// there, and its parent kills it): see [`set_test_hook`].
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum TestPoint {
    /// A publisher opened its write and stored half of the payload words.
    WriteHalfStored,
    /// A repairer took a dead writer's lock and adopted its open write; nothing stored yet.
    RepairAdopted,
    /// A repairer stored the free state and half of the zeroed payload; the sequence is odd.
    RepairHalfCleared,
    /// A repairer stored the whole free payload; the sequence is still odd.
    RepairCleared,
    /// The repair is closed (sequence even); the writer lock is not released yet.
    RepairClosed,
}

static TEST_HOOK: std::sync::OnceLock<fn(TestPoint)> = std::sync::OnceLock::new();

/// Installs a function called at every [`TestPoint`] this process reaches (once per process; later
/// calls are ignored). For tests that stop a writer or a repairer at the worst moment; costs one
/// atomic load per publish when unset.
#[doc(hidden)]
pub fn set_test_hook(hook: fn(TestPoint)) {
    let _ = TEST_HOOK.set(hook);
}

/// Calls the test hook, if one is installed.
pub(crate) fn test_point(p: TestPoint) {
    if let Some(h) = TEST_HOOK.get() {
        h(p);
    }
}

/// The production "carry on" at every test point: the hook (if any) runs, and the repair goes on.
fn go_on(p: TestPoint) -> bool {
    test_point(p);
    true
}

/// A slot seen through references to its atomics.
#[derive(Clone, Copy)]
pub(crate) struct SlotView<'a> {
    pub(crate) writer: &'a AtomicU64,
    pub(crate) lock: SeqLock<'a>,
}

/// What taking a slot's writer lock found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Taken {
    /// The lock was free.
    Clean,
    /// The lock was taken over from a dead holder (or from an impossible odd sequence with no
    /// holder); `dropped_record` tells whether a half-written record was thrown away (slot freed).
    Recovered { dropped_record: bool },
}

impl<'a> SlotView<'a> {
    /// One attempt to take the writer lock for `me` (a non-zero lock name). Takes it over when the
    /// holder is dead per `is_dead`, and then repairs a write it left open.
    pub(crate) fn try_lock(&self, me: u64, is_dead: &dyn Fn(u64) -> bool) -> Option<Taken> {
        self.try_lock_with(me, is_dead, &go_on)
    }

    /// [`SlotView::try_lock`] with the repair's steps reported to `step`; when `step` returns
    /// `false` the repairer "dies" there (loom models): it stops, leaving the lock held and the
    /// write open, and `None` is returned.
    pub(crate) fn try_lock_with(
        &self,
        me: u64,
        is_dead: &dyn Fn(u64) -> bool,
        step: &dyn Fn(TestPoint) -> bool,
    ) -> Option<Taken> {
        // SYNC POINT holder: Acquire, pairs with the Release half of the holder's compare-exchange
        // below; a holder's lock name is only read after its participant entry was sealed, so
        // `is_dead` sees the holder's sealed entry (or a later state of it).
        let cur = self.writer.load(Ordering::Acquire);
        if cur == 0 {
            // AcqRel on success: the Acquire half pairs with the previous holder's Release in
            // `unlock`, so its payload stores are visible to us; the Release half pairs with the
            // Acquire load above in other lockers (SYNC POINT holder).
            self.writer
                .compare_exchange(0, me, Ordering::AcqRel, Ordering::Relaxed)
                .ok()?;
            // An odd sequence with the lock free cannot come from a live writer (they close the write
            // before unlocking): corruption. Repair it like an abandoned write.
            return match self.repair_open_write(step)? {
                true => Some(Taken::Recovered {
                    dropped_record: true,
                }),
                false => Some(Taken::Clean),
            };
        }
        if cur != me && is_dead(cur) {
            // AcqRel: the Acquire half pairs with the dead holder's last Release (if any) and orders
            // our repair after whatever it managed to store; the Release half as above.
            self.writer
                .compare_exchange(cur, me, Ordering::AcqRel, Ordering::Relaxed)
                .ok()?;
            let dropped_record = self.repair_open_write(step)?;
            return Some(Taken::Recovered { dropped_record });
        }
        None
    }

    /// Drops a write left open (by a dead writer, or by a repairer that died): the sequence stays
    /// odd while the payload is overwritten with a free slot, and is made even only after the last
    /// store. `Some(true)` when there was an open write, `Some(false)` when none, `None` when
    /// `step` asked to stop half-way.
    ///
    /// A repairer that dies at any point leaves the sequence odd and its own name in the writer
    /// word; the next locker finds it dead, takes the lock over and repeats all of this (the stores
    /// are the same, so repeating them is harmless). Readers retry an odd sequence, so none ever
    /// copies the half-written payload.
    fn repair_open_write(&self, step: &dyn Fn(TestPoint) -> bool) -> Option<bool> {
        let Some(w) = self.lock.adopt_open_write() else {
            return Some(false);
        };
        if !step(TestPoint::RepairAdopted) {
            std::mem::forget(w);
            return None;
        }
        // The state first: even a copy made without the sequence check would read a free slot.
        w.store(W_STATE, u64::from(STATE_FREE));
        let n = self.lock.len();
        for i in (0..n).filter(|i| *i != W_STATE) {
            w.store(i, 0);
            if i == n / 2 && !step(TestPoint::RepairHalfCleared) {
                std::mem::forget(w);
                return None;
            }
        }
        if !step(TestPoint::RepairCleared) {
            std::mem::forget(w);
            return None;
        }
        w.finish();
        if !step(TestPoint::RepairClosed) {
            return None;
        }
        Some(true)
    }

    /// Releases the writer lock held by `me`.
    pub(crate) fn unlock(&self, me: u64) {
        // Release: pairs with the next locker's Acquire compare-exchange.
        let _ = self
            .writer
            .compare_exchange(me, 0, Ordering::Release, Ordering::Relaxed);
    }

    /// Reads the payload into `out` with up to `retries` seqlock attempts.
    pub(crate) fn read(
        &self,
        out: &mut [u64; PAYLOAD_WORDS],
        retries: u32,
    ) -> Result<u64, ShmError> {
        self.lock.read(out, retries)
    }

    /// The current writer's lock name (`Acquire`, SYNC POINT holder: a caller that then looks up
    /// the holder's participant entry sees it sealed).
    pub(crate) fn holder(&self) -> u64 {
        self.writer.load(Ordering::Acquire)
    }
}

#[cfg(all(test, loom))]
mod loom_model {
    //! Model of the slot state machine: writers lock, write and publish; a reader never sees a torn
    //! payload; a writer that "dies" mid-write (its guard forgotten, its token declared dead) leaves
    //! a slot that the next locker recovers and frees.
    use super::*;
    use crate::registry::layout::STATE_PUBLISHED;
    use loom::sync::Arc;

    const N: usize = 3;

    struct Mem {
        writer: AtomicU64,
        seq: AtomicU64,
        words: Vec<AtomicU64>,
    }

    impl Mem {
        fn new() -> Arc<Self> {
            Arc::new(Self {
                writer: AtomicU64::new(0),
                seq: AtomicU64::new(0),
                words: (0..PAYLOAD_WORDS).map(|_| AtomicU64::new(0)).collect(),
            })
        }
        fn view(&self) -> SlotView<'_> {
            SlotView {
                writer: &self.writer,
                lock: SeqLock::new(&self.seq, &self.words[..N]),
            }
        }
    }

    fn publish(m: &Mem, me: u64, v: u64) -> bool {
        let s = m.view();
        if s.try_lock(me, &|_| false).is_none() {
            return false;
        }
        let w = s.lock.try_write().expect("lock holder opens the write");
        w.store(W_STATE, u64::from(STATE_PUBLISHED));
        for i in 1..N {
            w.store(i, v);
        }
        w.finish();
        s.unlock(me);
        true
    }

    fn check_read(m: &Mem) {
        let mut out = [0u64; PAYLOAD_WORDS];
        if m.view().lock.read(&mut out[..N], 2).is_ok() {
            let st = out[0];
            assert!(st == 0 || st == u64::from(STATE_PUBLISHED));
            if st == 0 {
                assert!(
                    out[1..N].iter().all(|x| *x == 0),
                    "free slot with data {out:?}"
                );
            } else {
                assert!(out[1..N].iter().all(|x| *x == out[1]), "torn read {out:?}");
            }
        }
    }

    #[test]
    fn loom_two_writers_and_a_reader_never_tear() {
        let mut b = loom::model::Builder::new();
        b.preemption_bound = Some(3);
        b.check(|| {
            let m = Mem::new();
            let m1 = m.clone();
            let m2 = m.clone();
            let t1 = loom::thread::spawn(move || publish(&m1, 1, 11));
            let t2 = loom::thread::spawn(move || publish(&m2, 2, 22));
            check_read(&m);
            let a = t1.join().unwrap();
            let b = t2.join().unwrap();
            assert!(a || b);
            // Quiescent: the slot is unlocked and consistent.
            assert_eq!(m.writer.load(Ordering::Relaxed), 0);
            assert_eq!(m.seq.load(Ordering::Relaxed) % 2, 0);
        });
    }

    #[test]
    fn loom_writer_dying_mid_write_is_recovered_and_never_read() {
        let mut b = loom::model::Builder::new();
        b.preemption_bound = Some(3);
        b.check(|| {
            let m = Mem::new();
            let m1 = m.clone();
            // The dying writer: locks, opens the write, stores part of a record, and never closes.
            let t1 = loom::thread::spawn(move || {
                let s = m1.view();
                if s.try_lock(7, &|_| false).is_some() {
                    let w = s.lock.try_write().unwrap();
                    w.store(W_STATE, u64::from(STATE_PUBLISHED));
                    w.store(1, 5);
                    std::mem::forget(w);
                }
            });
            let m2 = m.clone();
            // A reader running alongside never sees the half-written record.
            let t2 = loom::thread::spawn(move || check_read(&m2));
            t1.join().unwrap();
            t2.join().unwrap();
            // After the death, a recovering locker (token 7 declared dead) frees the slot.
            let s = m.view();
            let taken = s
                .try_lock(9, &|t| t == 7)
                .expect("dead holder's lock is taken over");
            assert_eq!(
                taken,
                Taken::Recovered {
                    dropped_record: true
                }
            );
            s.unlock(9);
            let mut out = [0u64; PAYLOAD_WORDS];
            s.lock.read(&mut out[..N], 1).unwrap();
            assert_eq!(out[0], u64::from(STATE_FREE));
        });
    }

    /// A published record [11, 11] with a dead writer's half-written [22, ·] over it: the writer
    /// (name 7) locked, opened its write, stored the state and one word, and died.
    fn torn_slot() -> Arc<Mem> {
        let m = Mem::new();
        assert!(publish(&m, 1, 11));
        let s = m.view();
        assert!(s.try_lock(7, &|_| false).is_some());
        let w = s.lock.try_write().unwrap();
        w.store(W_STATE, u64::from(STATE_PUBLISHED));
        w.store(1, 22);
        std::mem::forget(w);
        m
    }

    #[test]
    fn loom_reader_beside_a_repairer_never_sees_the_half_written_record() {
        let mut b = loom::model::Builder::new();
        b.preemption_bound = Some(3);
        b.check(|| {
            let m = torn_slot();
            let m1 = m.clone();
            let repairer = loom::thread::spawn(move || {
                let s = m1.view();
                let t = s.try_lock(9, &|t| t == 7).expect("the dead writer's lock");
                assert_eq!(
                    t,
                    Taken::Recovered {
                        dropped_record: true
                    }
                );
                s.unlock(9);
            });
            check_read(&m);
            repairer.join().unwrap();
            let mut out = [0u64; PAYLOAD_WORDS];
            m.view().lock.read(&mut out[..N], 1).unwrap();
            assert_eq!(&out[..N], &[0; N]);
        });
    }

    /// A repairer (name 9) that dies at each step of the repair; a second one (name 10) takes the
    /// lock over and finishes. A reader running beside both never sees the torn record.
    #[test]
    fn loom_a_repairer_dying_at_any_step_is_taken_over_and_never_read_torn() {
        for stop in [
            TestPoint::RepairAdopted,
            TestPoint::RepairHalfCleared,
            TestPoint::RepairCleared,
            TestPoint::RepairClosed,
        ] {
            let mut b = loom::model::Builder::new();
            b.preemption_bound = Some(2);
            b.check(move || {
                let m = torn_slot();
                let m1 = m.clone();
                let reader = loom::thread::spawn(move || {
                    check_read(&m1);
                    check_read(&m1);
                });
                let m2 = m.clone();
                let first = loom::thread::spawn(move || {
                    let died = m2
                        .view()
                        .try_lock_with(9, &|t| t == 7, &|p| p != stop)
                        .is_none();
                    assert!(died, "the first repairer dies at {stop:?}");
                });
                first.join().unwrap();
                // The first repairer is dead now: the second finds its name dead and finishes.
                let s = m.view();
                let t = s
                    .try_lock(10, &|t| t == 7 || t == 9)
                    .expect("the dead repairer's lock");
                assert!(matches!(t, Taken::Recovered { .. }));
                s.unlock(10);
                reader.join().unwrap();
                let mut out = [0u64; PAYLOAD_WORDS];
                s.lock.read(&mut out[..N], 1).unwrap();
                assert_eq!(&out[..N], &[0; N]);
                assert_eq!(m.writer.load(Ordering::Relaxed), 0);
            });
        }
    }
}
