//! The slot protocol: the writer lock word, the seqlock around the payload, and recovery of a slot
//! whose writer died. Written against plain references to atomics so the loom model below runs the
//! same code on heap memory that the registry runs on the mapped segment.
//!
//! A slot is in one of these states (see docs/registry-layout.md):
//!
//! | writer | seq | payload state | meaning |
//! | --- | --- | --- | --- |
//! | 0 | even | FREE | free |
//! | token | even | any | locked by a writer that has not opened (or has closed) its write |
//! | token | odd | any | writing: readers retry, then skip |
//! | 0 | even | PUBLISHED | published |
//! | token of a dead process | any | any | abandoned: the next locker takes it over; if seq was odd the half-written record is dropped (slot freed) |

use super::layout::{PAYLOAD_WORDS, STATE_FREE, W_STATE};
use crate::registry::RegistryError;
use crate::shm::SeqLock;
use crate::sync::{AtomicU64, Ordering};

/// A slot seen through references to its atomics.
#[derive(Clone, Copy)]
pub(crate) struct SlotView<'a> {
    pub writer: &'a AtomicU64,
    pub lock: SeqLock<'a>,
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
    /// One attempt to take the writer lock for `me` (a non-zero owner token). Takes it over when the
    /// holder is dead per `is_dead`, and then repairs a write it left open.
    pub fn try_lock(&self, me: u64, is_dead: &dyn Fn(u64) -> bool) -> Option<Taken> {
        // Relaxed: only a hint for which compare-exchange to try.
        let cur = self.writer.load(Ordering::Relaxed);
        if cur == 0 {
            // Acquire on success: pairs with the previous holder's Release in `unlock`, so its payload
            // stores are visible to us.
            self.writer
                .compare_exchange(0, me, Ordering::Acquire, Ordering::Relaxed)
                .ok()?;
            // An odd sequence with the lock free cannot come from a live writer (they close the write
            // before unlocking): corruption. Repair it like an abandoned write.
            if self.repair_open_write() {
                return Some(Taken::Recovered {
                    dropped_record: true,
                });
            }
            return Some(Taken::Clean);
        }
        if cur != me && is_dead(cur) {
            // Acquire: pairs with the dead holder's last Release (if any) and orders our repair after
            // whatever it managed to store.
            self.writer
                .compare_exchange(cur, me, Ordering::Acquire, Ordering::Relaxed)
                .ok()?;
            let dropped_record = self.repair_open_write();
            return Some(Taken::Recovered { dropped_record });
        }
        None
    }

    /// Closes a write left open and frees the slot; `true` when there was one.
    fn repair_open_write(&self) -> bool {
        if !self.lock.recover() {
            return false;
        }
        if let Some(w) = self.lock.try_write() {
            for i in 0..self.lock.len() {
                w.store(i, 0);
            }
            w.store(W_STATE, u64::from(STATE_FREE));
            w.finish();
        }
        true
    }

    /// Releases the writer lock held by `me`.
    pub fn unlock(&self, me: u64) {
        // Release: pairs with the next locker's Acquire compare-exchange.
        let _ = self
            .writer
            .compare_exchange(me, 0, Ordering::Release, Ordering::Relaxed);
    }

    /// Reads the payload into `out` with up to `retries` seqlock attempts.
    pub fn read(&self, out: &mut [u64; PAYLOAD_WORDS], retries: u32) -> Result<u64, RegistryError> {
        self.lock.read(out, retries)
    }

    /// The current writer token (`Relaxed`: used only to decide whether to check liveness).
    pub fn holder(&self) -> u64 {
        self.writer.load(Ordering::Relaxed)
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
}
