//! A seqlock over a block of `AtomicU64` payload words, for records in shared memory.
//!
//! One sequence word guards the payload: even means stable, odd means a writer is inside. Writers
//! make it odd, store the payload words, and make it even again; readers copy the payload with
//! atomic word loads and keep the copy only if the sequence was even and unchanged around it. The
//! payload words are atomics (not plain bytes), so a reader racing a writer reads stale or new words,
//! never undefined behaviour, and the sequence check throws such a copy away.
//!
//! Orderings (each pairs with the one named):
//!
//! | writer | reader |
//! | --- | --- |
//! | `seq` compare-exchange even → odd (`Acquire`), then `fence(Release)` | `fence(Acquire)` after the payload loads, then `seq` load (`Relaxed`) |
//! | payload stores (`Relaxed`) | payload loads (`Relaxed`) |
//! | `seq` store odd + 1 (`Release`) | first `seq` load (`Acquire`) |
//!
//! A writer that dies inside leaves the sequence odd. Reads then fail after a bounded number of
//! attempts with [`ShmError::WriterStalled`] instead of spinning forever, and whoever owns the
//! recovery (the registry, after checking the writer is dead) adopts the open write
//! ([`SeqLock::adopt_open_write`]): it overwrites the payload while the sequence is still odd and
//! only then makes it even, so the half-written payload is never published, not even for a moment.
//!
//! | repairer | reader |
//! | --- | --- |
//! | `seq` load sees odd, then `fence(Release)` (`adopt_open_write`) | `fence(Acquire)` after the payload loads, then `seq` load |
//! | payload stores (`Relaxed`), then `seq` store odd + 1 (`Release`) | first `seq` load (`Acquire`) |

use super::ShmError;
use crate::sync::{AtomicU64, Ordering, fence};

/// Read attempts before the reader yields the CPU between attempts.
const SPINS_BEFORE_YIELD: u32 = 32;

/// A seqlock: a sequence word and the payload words it guards, both in shared memory.
///
/// Mutual exclusion between writers is the caller's affair only in the sense that
/// [`SeqLock::try_write`] fails while another write is open; a writer that must wait for another
/// uses its own lock (the registry uses a per-slot writer word that records who holds it).
#[derive(Clone, Copy, Debug)]
pub struct SeqLock<'a> {
    seq: &'a AtomicU64,
    words: &'a [AtomicU64],
}

impl<'a> SeqLock<'a> {
    /// A seqlock with sequence word `seq` guarding `words`.
    pub fn new(seq: &'a AtomicU64, words: &'a [AtomicU64]) -> Self {
        Self { seq, words }
    }

    /// The number of payload words.
    pub fn len(&self) -> usize {
        self.words.len()
    }

    /// `true` when there are no payload words.
    pub fn is_empty(&self) -> bool {
        self.words.is_empty()
    }

    /// The current sequence value (`Acquire`, pairing with a writer's closing `Release` store).
    pub fn sequence(&self) -> u64 {
        self.seq.load(Ordering::Acquire)
    }

    /// Opens a write: turns an even sequence odd. `None` when a write is already open (odd).
    pub fn try_write(&self) -> Option<SeqWriter<'a>> {
        // Relaxed: a stale value only makes the compare-exchange fail or retry.
        let s = self.seq.load(Ordering::Relaxed);
        if s & 1 == 1 {
            return None;
        }
        // Acquire on success: pairs with the previous writer's closing Release store, so our payload
        // stores come after theirs.
        self.seq
            .compare_exchange(s, s.wrapping_add(1), Ordering::Acquire, Ordering::Relaxed)
            .ok()?;
        // Release fence: pairs with the reader's Acquire fence; a reader that sees any payload store
        // below then sees the odd sequence on its re-check.
        fence(Ordering::Release);
        Some(SeqWriter {
            lock: *self,
            start: s.wrapping_add(1),
            done: false,
        })
    }

    /// Copies the payload into `out` (its first `min(out.len(), len())` words) and returns the even
    /// sequence the copy is consistent with.
    ///
    /// Makes at most `max_retries` attempts (at least one); spins for the first few, then yields.
    ///
    /// # Errors
    /// [`ShmError::WriterStalled`] when every attempt found a write open or racing.
    pub fn read(&self, out: &mut [u64], max_retries: u32) -> Result<u64, ShmError> {
        let n = out.len().min(self.words.len());
        let attempts = max_retries.max(1);
        for attempt in 0..attempts {
            // Acquire: pairs with the writer's closing Release store; the payload it wrote is visible.
            let s1 = self.seq.load(Ordering::Acquire);
            if s1 & 1 == 0 {
                for (o, w) in out[..n].iter_mut().zip(self.words) {
                    // Relaxed: validated by the sequence re-check below.
                    *o = w.load(Ordering::Relaxed);
                }
                // Acquire fence: pairs with the writer's Release fence after it made the sequence odd;
                // if any load above saw a store of a newer write, the load below sees its odd value.
                fence(Ordering::Acquire);
                // Relaxed: ordered after the payload loads by the fence above.
                let s2 = self.seq.load(Ordering::Relaxed);
                if s1 == s2 {
                    return Ok(s1);
                }
            }
            backoff(attempt);
        }
        Err(ShmError::WriterStalled { retries: attempts })
    }

    /// Takes over a write left open by a writer that died: when the sequence is odd, returns a
    /// [`SeqWriter`] for that same open write, with the sequence still odd. `None` when no write is
    /// open (the sequence is even).
    ///
    /// The sequence stays odd until the caller has stored what the record must become and calls
    /// [`SeqWriter::finish`], so readers keep retrying and never copy the half-written payload. A
    /// caller that dies before `finish` leaves the sequence odd, and the next caller adopts the same
    /// write and stores everything again. Call this only while holding the caller's own exclusion
    /// over the record, taken from the dead writer (the registry's slot writer lock).
    pub fn adopt_open_write(&self) -> Option<SeqWriter<'a>> {
        // Relaxed: the caller's exclusion (taken with Acquire) orders this after the dead writer; what
        // matters for readers is that this load, which sees the odd value, comes before the fence.
        let s = self.seq.load(Ordering::Relaxed);
        if s & 1 == 0 {
            return None;
        }
        // SYNC POINT adopt: Release fence, pairs with the reader's Acquire fence after its payload
        // loads. A reader that copied any payload store made below synchronises with this fence, so
        // the load above (which saw the odd value) happens before its re-check of the sequence,
        // which then sees that odd value or a later one and throws the copy away.
        fence(Ordering::Release);
        Some(SeqWriter {
            lock: *self,
            start: s,
            done: false,
        })
    }
}

/// An open write on a [`SeqLock`]; [`SeqWriter::finish`] (or dropping it) makes the sequence even.
#[derive(Debug)]
pub struct SeqWriter<'a> {
    lock: SeqLock<'a>,
    start: u64,
    done: bool,
}

impl SeqWriter<'_> {
    /// Stores payload word `i` (`Relaxed`; published by the closing `Release` store).
    ///
    /// # Panics
    /// When `i >= len()` (a caller bug; the registry indexes with constants).
    pub fn store(&self, i: usize, value: u64) {
        // Relaxed: ordered before the closing Release store of the sequence.
        self.lock.words[i].store(value, Ordering::Relaxed);
    }

    /// Loads payload word `i` as this writer last left it (`Relaxed`; no other writer is inside).
    ///
    /// # Panics
    /// When `i >= len()`.
    pub fn load(&self, i: usize) -> u64 {
        // Relaxed: the writer's own stores and those of earlier writers (ordered by try_write's
        // Acquire) are visible to it.
        self.lock.words[i].load(Ordering::Relaxed)
    }

    /// The odd sequence value of this write.
    pub fn sequence(&self) -> u64 {
        self.start
    }

    /// Closes the write; returns the new, even sequence.
    pub fn finish(mut self) -> u64 {
        self.close()
    }

    fn close(&mut self) -> u64 {
        self.done = true;
        let end = self.start.wrapping_add(1);
        // Release: pairs with the reader's first Acquire load of the sequence; publishes the payload.
        self.lock.seq.store(end, Ordering::Release);
        end
    }
}

impl Drop for SeqWriter<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.close();
        }
    }
}

/// Spins for the first attempts, then gives the CPU away (a preempted writer needs it).
fn backoff(attempt: u32) {
    if attempt < SPINS_BEFORE_YIELD {
        #[cfg(not(loom))]
        std::hint::spin_loop();
        #[cfg(loom)]
        loom::thread::yield_now();
    } else {
        #[cfg(not(loom))]
        std::thread::yield_now();
        #[cfg(loom)]
        loom::thread::yield_now();
    }
}
