//! The holds a reader's `wait_newer_async` waits park ([`Parking`]): each until its coroutine
//! claims it, or, once that coroutine gave up, until the reader's next take hands it out or lets
//! it go; and the waits that park them ([`Job`]). The reader's takes (`take_slice`,
//! `current_now`), its `_claim` and its `close()` go through [`Parking`]'s methods, under the
//! reader's lock of it. Imports nothing of the reader.

use crate::util::Stop;
use cuda_ipc::tensorset::owned::OwnedHeld;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

/// The holds `wait_newer_async` waits parked, and what decides who gets them.
///
/// A parked hold whose coroutine gave up goes to the reader's next take, oldest generation
/// first: `wait_newer(than)` (also awaited) returns it when it is newer than `than`, without
/// waiting, and lets go of every such hold no newer than `than` (the caller asks past them);
/// `current()` returns the newest of the parked holds and the generation published now, and lets
/// the others go. A parked hold older than the newest generation this reader already handed out
/// is let go, never handed out: the reader's callers never see generation g + 1 and then g.
#[derive(Default)]
pub(super) struct Parking {
    holds: Vec<Parked>,
    /// The newest generation handed to a caller (a take's result, a claim).
    handed: u64,
    /// Set by `close()`, under this lock: a take that finishes after it parks nothing and hands
    /// nothing out.
    closed: bool,
}

/// A hold a `wait_newer_async` wait took for its coroutine.
pub(super) struct Parked {
    job: u64,
    /// Raised when that coroutine gave up ([`crate::aio::is_abandoned`]).
    abandoned: Arc<AtomicBool>,
    held: OwnedHeld,
}

impl Parked {
    fn generation(&self) -> u64 {
        self.held.held().generation()
    }

    fn is_abandoned(&self) -> bool {
        crate::aio::is_abandoned(&self.abandoned)
    }
}

/// How long an awaited wait sleeps between looks at an earlier wait's hold that its coroutine
/// has neither claimed nor given up yet.
pub(super) const PENDING_POLL: Duration = Duration::from_micros(200);

impl Parking {
    /// The oldest parked hold whose coroutine gave up that `wait_newer(than)` may hand out, taken
    /// out; those it may not (no newer than `than`, or older than the newest handed out) go to
    /// `let_go`, to be released by the caller after the lock.
    pub(super) fn take_abandoned(
        &mut self,
        than: u64,
        let_go: &mut Vec<OwnedHeld>,
    ) -> Option<OwnedHeld> {
        let handed = self.handed;
        let (stale, kept): (Vec<Parked>, Vec<Parked>) = std::mem::take(&mut self.holds)
            .into_iter()
            .partition(|p| p.is_abandoned() && (p.generation() <= than || p.generation() < handed));
        self.holds = kept;
        let_go.extend(stale.into_iter().map(|p| p.held));
        let i = (0..self.holds.len())
            .filter(|&i| self.holds[i].is_abandoned())
            .min_by_key(|&i| self.holds[i].generation())?;
        Some(self.holds.remove(i).held)
    }

    /// Whether a hold waits for its coroutine's claim (an earlier awaited wait took it, and that
    /// coroutine neither claimed it nor gave up yet). Any such hold, also one no newer than a
    /// later wait's `than`: that coroutine returns it even when another wait of the reader
    /// (another task's, asking with what a third task saw) returned a newer one meanwhile.
    pub(super) fn pending(&self) -> bool {
        self.holds.iter().any(|p| !p.is_abandoned())
    }

    /// `h`, handed to a caller now; `Closed` (and `h` released) once `close()` came.
    pub(super) fn hand_out(&mut self, h: OwnedHeld) -> Result<OwnedHeld, Stop> {
        if self.closed {
            drop(h);
            return Err(Stop::Closed);
        }
        self.handed = self.handed.max(h.held().generation());
        Ok(h)
    }

    /// `h`, parked for job `job`'s coroutine; `Closed` (and `h` released) once `close()` came.
    pub(super) fn park(&mut self, job: &Job<'_>, h: OwnedHeld) -> Result<(), Stop> {
        if self.closed {
            drop(h);
            return Err(Stop::Closed);
        }
        self.holds.push(Parked {
            job: job.id,
            abandoned: job.abandoned.clone(),
            held: h,
        });
        Ok(())
    }

    /// The hold parked for job `job`, taken out and handed to its coroutine (`_claim`); `None`
    /// when there is none (`close()` released it).
    pub(super) fn claim(&mut self, job: u64) -> Option<OwnedHeld> {
        match self.holds.iter().position(|h| h.job == job) {
            Some(i) => {
                let h = self.holds.remove(i).held;
                self.handed = self.handed.max(h.held().generation());
                Some(h)
            }
            None => None,
        }
    }

    /// Closes the parking (`close()`): a take that finishes after it parks and hands out
    /// nothing. Returns the parked holds, for the caller to release after the lock.
    pub(super) fn close(&mut self) -> Vec<Parked> {
        self.closed = true;
        std::mem::take(&mut self.holds)
    }
}

/// A `wait_newer_async` wait: its number, its cancellation flag and the flag its coroutine
/// raises when it gives up (`crate::aio`).
pub(super) struct Job<'a> {
    pub(super) id: u64,
    pub(super) cancelled: &'a AtomicBool,
    pub(super) abandoned: &'a Arc<AtomicBool>,
}
