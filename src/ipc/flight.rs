//! The single-flight table every import cache of this crate is made of: at most one open per key at
//! a time, its result shared with the callers of that key who waited for it, and callers of other
//! keys never waiting.
//!
//! Owns: [`SingleFlight`] and [`Lease`]. The import caches ([`super::cache`]: legacy and fd
//! mappings, imported pools, opened IPC events) are each one `SingleFlight`; the driver calls and
//! the fd fetch are the `open` closures their callers pass. Knows nothing of CUDA.
//!
//! # The states of one key
//! - **absent**: the caller becomes the opener. It marks the key `Opening`, releases the table lock
//!   and runs `open` (a driver open, a socket fetch of up to seconds) with no lock held, so other
//!   keys are served meanwhile.
//! - **`Opening`**: later callers of the key wait on the table's condition variable (the lock is
//!   released while they wait).
//!   - Success: the opener stores `Open(Weak)` and wakes them; they share its value.
//!   - Failure: the opener puts a copy of its error in the attempt's cell, removes the key and wakes
//!     them. Every caller that waited for *that attempt* returns the same error as the opener (not
//!     retried: a dead or stalled exporter costs one timeout, not one per waiting thread). Nothing
//!     is remembered beyond the attempt: the next caller tries again.
//!   - A panic in `open` counts as a failure (the waiters get an error saying so).
//! - **`Open`, value alive**: a hit.
//! - **`Open`, value dropping** (its last `Arc` is gone and its `Drop` is closing it): callers wait
//!   until the value's [`Lease`] removes the key. The lease is the value's last field, so it drops
//!   after the value closed its driver object: a new open of the key starts only after the old
//!   close finished. There is never a second live mapping of one key, and a close never hits a
//!   mapping a later import got.
//!
//! So every key sees exactly one open and one close per value, whatever the order of imports and
//! drops across threads.
//!
//! # Locking
//! One mutex per table guards the slots; it is held only to read or change a slot, never across
//! `open` or a value's drop (a value is never dropped while the lock is held: a hit returns the
//! upgraded `Arc` after unlocking). Waiting uses one condition variable per table, notified on
//! every change of a slot; waiters re-check their key, so a wake-up for another key costs a look.
//! Opens are rare (the cache serves the rest), so this stays cheap.

use crate::error::{Error, OsError, Result};
#[cfg(test)]
use crate::ipc::fdpass::FdPassError;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError, Weak};

/// One attempt to open a key: its number and, when it failed, the error its waiters return.
#[derive(Debug)]
struct Attempt {
    id: u64,
    failure: OnceLock<Error>,
}

impl Attempt {
    fn new() -> Arc<Attempt> {
        // Relaxed: a unique number, nothing is published through it.
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Arc::new(Attempt {
            id: NEXT.fetch_add(1, Ordering::Relaxed),
            failure: OnceLock::new(),
        })
    }
}

enum Slot<V> {
    /// An opener runs `open` for this attempt.
    Opening(Arc<Attempt>),
    /// Opened by attempt `attempt`; the value may be dropping (strong count 0).
    Open { attempt: u64, value: Weak<V> },
}

/// How [`SingleFlight::get_or_open`] served a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Served {
    /// This caller ran `open`; `waited` when it first waited for another caller's failed open or
    /// for the close of the key's previous value.
    Opened { waited: bool },
    /// The value existed or another caller opened it; `waited` when this caller waited for that
    /// open (or a close of the key) first.
    Hit { waited: bool },
}

/// A table of values by key with single-flight opens (see the [module docs](self)).
pub(crate) struct SingleFlight<K, V> {
    slots: Mutex<BTreeMap<K, Slot<V>>>,
    /// Notified after every change of a slot (paired with the waits in `get_or_open`).
    changed: Condvar,
}

impl<K: Ord + Clone, V> SingleFlight<K, V> {
    /// An empty table (for a `static`).
    pub(crate) const fn new() -> Self {
        Self {
            slots: Mutex::new(BTreeMap::new()),
            changed: Condvar::new(),
        }
    }

    /// Locks the slots, recovering from poisoning: every critical section is one insert, remove or
    /// look-up, which a panic elsewhere cannot leave half done.
    fn lock(&self) -> MutexGuard<'_, BTreeMap<K, Slot<V>>> {
        self.slots.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The value of `key`: shared when it exists, else opened by exactly one caller with
    /// `open(lease)`, while the other callers of `key` wait for it. `open` must store the [`Lease`]
    /// as the value's last field (dropped after the value closed what it opened).
    ///
    /// # Errors
    /// What `open` returned, to the opener and (as a copy) to every caller that waited for that
    /// attempt; an error naming the panic when `open` panicked in another thread.
    pub(crate) fn get_or_open(
        &'static self,
        key: K,
        open: impl FnOnce(Lease<K, V>) -> Result<V>,
    ) -> Result<(Arc<V>, Served)> {
        let mut waited = false;
        let mut waiting_for: Option<Arc<Attempt>> = None;
        let mut slots = self.lock();
        let attempt = loop {
            if let Some(e) = waiting_for.as_ref().and_then(|a| a.failure.get()) {
                return Err(copy_error(e));
            }
            match slots.get(&key) {
                None => {
                    let a = Attempt::new();
                    slots.insert(key.clone(), Slot::Opening(Arc::clone(&a)));
                    break a;
                }
                Some(Slot::Open { value, .. }) => {
                    if let Some(v) = value.upgrade() {
                        drop(slots);
                        return Ok((v, Served::Hit { waited }));
                    }
                    // Dropping: its lease removes the slot once it is closed.
                }
                Some(Slot::Opening(a)) => waiting_for = Some(Arc::clone(a)),
            }
            waited = true;
            // Pairs with the `notify_all` after every slot change (open done, failed, lease freed).
            slots = self
                .changed
                .wait(slots)
                .unwrap_or_else(PoisonError::into_inner);
        };
        drop(slots);
        let guard = OpenGuard {
            table: self,
            key: &key,
            attempt: &attempt,
        };
        let lease = Lease {
            table: self,
            key: key.clone(),
            attempt: attempt.id,
        };
        match open(lease) {
            Ok(v) => {
                let v = Arc::new(v);
                self.lock().insert(
                    key.clone(),
                    Slot::Open {
                        attempt: attempt.id,
                        value: Arc::downgrade(&v),
                    },
                );
                self.changed.notify_all();
                drop(guard); // the slot is no longer `Opening`: does nothing
                Ok((v, Served::Opened { waited }))
            }
            Err(e) => {
                // Set before the guard removes the slot and wakes the waiters.
                let _ = attempt.failure.set(copy_error(&e));
                drop(guard);
                Err(e)
            }
        }
    }

    /// Whether `key` has a live value or an open under way: a [`SingleFlight::get_or_open`] of it
    /// now would be served without running its `open` (a value that is dropping counts as
    /// absent: the next call opens anew). Only a hint: the slot may change right after.
    pub(crate) fn is_present(&self, key: &K) -> bool {
        match self.lock().get(key) {
            None => false,
            Some(Slot::Opening(_)) => true,
            Some(Slot::Open { value, .. }) => value.strong_count() > 0,
        }
    }

    /// Values alive now.
    pub(crate) fn live(&self) -> usize {
        self.lock()
            .values()
            .filter(|s| matches!(s, Slot::Open { value, .. } if value.strong_count() > 0))
            .count()
    }
}

/// Ends an attempt that did not store a value: on an error (its failure is set) or a panic in
/// `open` (then it sets one), removes the `Opening` slot and wakes the waiters.
struct OpenGuard<'a, K: Ord + Clone, V> {
    table: &'a SingleFlight<K, V>,
    key: &'a K,
    attempt: &'a Arc<Attempt>,
}

impl<K: Ord + Clone, V> Drop for OpenGuard<'_, K, V> {
    fn drop(&mut self) {
        let mut slots = self.table.lock();
        if matches!(slots.get(self.key), Some(Slot::Opening(a)) if Arc::ptr_eq(a, self.attempt)) {
            let _ = self.attempt.failure.set(Error::InvalidArgument(
                "the import of this handle panicked in another thread".into(),
            ));
            slots.remove(self.key);
            drop(slots);
            self.table.changed.notify_all();
        }
    }
}

/// A value's claim on its slot: dropping it (after the value closed what it opened) frees the key
/// for the next open. Store it as the value's last field.
pub(crate) struct Lease<K: Ord + Clone + 'static, V: 'static> {
    table: &'static SingleFlight<K, V>,
    key: K,
    attempt: u64,
}

impl<K: Ord + Clone + 'static, V: 'static> Drop for Lease<K, V> {
    fn drop(&mut self) {
        let mut slots = self.table.lock();
        // Only the slot this value was opened into: a lease dropped by a failed `open` finds its
        // slot still `Opening` and leaves it to the opener's guard.
        if matches!(slots.get(&self.key), Some(Slot::Open { attempt, .. }) if *attempt == self.attempt)
        {
            slots.remove(&self.key);
        }
        drop(slots);
        self.table.changed.notify_all();
    }
}

impl<K: Ord + Clone + std::fmt::Debug + 'static, V: 'static> std::fmt::Debug for Lease<K, V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("key", &self.key)
            .field("attempt", &self.attempt)
            .finish()
    }
}

/// A copy of `e` for the callers that waited for a failed open (errors are not `Clone`: an OS
/// error is copied by its errno, or by its kind and text).
pub(crate) fn copy_error(e: &Error) -> Error {
    match e {
        Error::DriverNotFound { searched } => Error::DriverNotFound {
            searched: searched.clone(),
        },
        Error::Cuda(c) => Error::Cuda(*c),
        Error::Os(o) => {
            let source = match o.source.raw_os_error() {
                Some(n) => std::io::Error::from_raw_os_error(n),
                None => std::io::Error::new(o.source.kind(), o.source.to_string()),
            };
            Error::Os(OsError::io(o.call, o.target.clone(), source))
        }
        Error::Unsupported { what, reason, fix } => Error::Unsupported {
            what,
            reason: reason.clone(),
            fix,
        },
        Error::InvalidToken(s) => Error::InvalidToken(s.clone()),
        Error::DeviceNotFound(u) => Error::DeviceNotFound(*u),
        Error::InvalidArgument(s) => Error::InvalidArgument(s.clone()),
        Error::FdPass(f) => Error::FdPass(f.clone()),
        Error::NotExportable(n) => Error::NotExportable(n.clone()),
        Error::NotImportable(n) => Error::NotImportable(n.clone()),
        Error::Quota(q) => Error::Quota(q.clone()),
        Error::TensorSet(t) => Error::TensorSet(t.clone()),
        Error::Timeout { what, after } => Error::Timeout {
            what,
            after: *after,
        },
        Error::ForkedChild { what } => Error::ForkedChild { what },
        // Not produced by any import; kept as text.
        Error::Shm(_) | Error::Registry(_) | Error::Channel(_) => {
            Error::InvalidArgument(e.to_string())
        }
        #[cfg(feature = "remote")]
        Error::Remote(_) => Error::InvalidArgument(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Barrier;
    use std::sync::atomic::AtomicUsize;
    use std::time::{Duration, Instant};

    /// A stand-in for a mapping: counts opens and closes, and checks no two live at once per key.
    struct Thing {
        id: usize,
        counters: &'static Counters,
        close_delay: Duration,
        _lease: Lease<u32, Thing>,
    }

    #[derive(Default)]
    struct Counters {
        opens: AtomicUsize,
        closes: AtomicUsize,
        live: AtomicUsize,
        max_live: AtomicUsize,
    }

    impl Counters {
        fn leak() -> &'static Counters {
            Box::leak(Box::default())
        }
        fn open(&'static self, lease: Lease<u32, Thing>, close_delay: Duration) -> Thing {
            // SeqCst: test bookkeeping read across threads, no data published through it.
            let id = self.opens.fetch_add(1, Ordering::SeqCst);
            let live = self.live.fetch_add(1, Ordering::SeqCst) + 1;
            self.max_live.fetch_max(live, Ordering::SeqCst);
            Thing {
                id,
                counters: self,
                close_delay,
                _lease: lease,
            }
        }
    }

    impl Drop for Thing {
        fn drop(&mut self) {
            // The "close": slow, and the lease drops only after it.
            std::thread::sleep(self.close_delay);
            self.counters.live.fetch_sub(1, Ordering::SeqCst);
            self.counters.closes.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn table() -> &'static SingleFlight<u32, Thing> {
        Box::leak(Box::new(SingleFlight::new()))
    }

    #[test]
    fn many_threads_importing_one_key_at_once_share_one_open_and_one_close() {
        let t = table();
        let c = Counters::leak();
        for round in 0..50 {
            let barrier = Arc::new(Barrier::new(8));
            let handles: Vec<_> = (0..8)
                .map(|_| {
                    let barrier = Arc::clone(&barrier);
                    std::thread::spawn(move || {
                        barrier.wait();
                        let (v, _) = t
                            .get_or_open(7, |lease| {
                                // A slow open, so the others arrive while it runs.
                                std::thread::sleep(Duration::from_millis(5));
                                Ok(c.open(lease, Duration::ZERO))
                            })
                            .unwrap();
                        v
                    })
                })
                .collect();
            let got: Vec<Arc<Thing>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
            assert!(got.iter().all(|v| Arc::ptr_eq(v, &got[0])), "round {round}");
            assert_eq!(c.opens.load(Ordering::SeqCst), round + 1);
            assert_eq!(c.closes.load(Ordering::SeqCst), round);
            drop(got);
            assert_eq!(c.closes.load(Ordering::SeqCst), round + 1);
            assert_eq!(t.live(), 0);
        }
        assert_eq!(c.max_live.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_slow_open_of_one_key_does_not_block_other_keys() {
        let t = table();
        let c = Counters::leak();
        let started = Arc::new(Barrier::new(2));
        let s2 = Arc::clone(&started);
        let slow = std::thread::spawn(move || {
            t.get_or_open(1, |lease| {
                s2.wait();
                std::thread::sleep(Duration::from_millis(1500));
                Ok(c.open(lease, Duration::ZERO))
            })
            .map(|(v, _)| v)
        });
        started.wait();
        let at = Instant::now();
        for key in 2..20 {
            let (v, how) = t
                .get_or_open(key, |lease| Ok(c.open(lease, Duration::ZERO)))
                .unwrap();
            assert!(matches!(how, Served::Opened { .. }), "{how:?}");
            drop(v);
        }
        assert!(
            at.elapsed() < Duration::from_millis(500),
            "other keys waited {:?} for a slow open",
            at.elapsed()
        );
        assert!(slow.join().unwrap().is_ok());
    }

    #[test]
    fn a_failed_open_is_reported_to_its_waiters_and_retried_by_later_callers() {
        let t = table();
        let c = Counters::leak();
        let tries: &'static AtomicUsize = Box::leak(Box::new(AtomicUsize::new(0)));
        let barrier = Arc::new(Barrier::new(6));
        let handles: Vec<_> = (0..6)
            .map(|_| {
                let barrier = Arc::clone(&barrier);
                std::thread::spawn(move || {
                    barrier.wait();
                    t.get_or_open(3, |_lease| {
                        tries.fetch_add(1, Ordering::SeqCst);
                        std::thread::sleep(Duration::from_millis(300));
                        Err(Error::FdPass(FdPassError::PeerGone { pid: 42 }))
                    })
                    .map(|_| ())
                })
            })
            .collect();
        for h in handles {
            let e = h.join().unwrap().unwrap_err();
            assert!(
                matches!(e, Error::FdPass(FdPassError::PeerGone { pid: 42 })),
                "{e}"
            );
        }
        // All six arrived within the first open's 300 ms: one attempt, its error shared.
        assert_eq!(tries.load(Ordering::SeqCst), 1);
        // Nothing is remembered: the next caller opens.
        let (v, how) = t
            .get_or_open(3, |lease| Ok(c.open(lease, Duration::ZERO)))
            .unwrap();
        assert_eq!(how, Served::Opened { waited: false });
        assert_eq!(v.id, 0);
    }

    #[test]
    fn a_panic_in_an_open_fails_its_waiters_and_frees_the_key() {
        let t = table();
        let c = Counters::leak();
        let started = Arc::new(Barrier::new(2));
        let s2 = Arc::clone(&started);
        let opener = std::thread::spawn(move || {
            let _ = t.get_or_open(5, |_lease| -> Result<Thing> {
                s2.wait();
                std::thread::sleep(Duration::from_millis(200));
                panic!("test panic in open");
            });
        });
        started.wait();
        let e = t
            .get_or_open(5, |lease| Ok(c.open(lease, Duration::ZERO)))
            .map(|_| ())
            .unwrap_err();
        assert!(e.to_string().contains("panicked"), "{e}");
        assert!(opener.join().is_err());
        let (_, how) = t
            .get_or_open(5, |lease| Ok(c.open(lease, Duration::ZERO)))
            .unwrap();
        assert!(matches!(how, Served::Opened { .. }), "{how:?}");
    }

    #[test]
    fn a_drop_racing_a_reimport_never_leaves_two_values_of_one_key() {
        let t = table();
        let c = Counters::leak();
        for _ in 0..40 {
            // The holder drops its value (a 20 ms close) while others import the key again.
            let (v, _) = t
                .get_or_open(9, |lease| Ok(c.open(lease, Duration::from_millis(20))))
                .unwrap();
            let barrier = Arc::new(Barrier::new(5));
            let b = Arc::clone(&barrier);
            let dropper = std::thread::spawn(move || {
                b.wait();
                drop(v);
            });
            let importers: Vec<_> = (0..4)
                .map(|_| {
                    let barrier = Arc::clone(&barrier);
                    std::thread::spawn(move || {
                        barrier.wait();
                        for _ in 0..3 {
                            let (v, _) = t
                                .get_or_open(9, |lease| Ok(c.open(lease, Duration::from_millis(1))))
                                .unwrap();
                            assert!(c.live.load(Ordering::SeqCst) >= 1);
                            drop(v);
                        }
                    })
                })
                .collect();
            dropper.join().unwrap();
            for h in importers {
                h.join().unwrap();
            }
        }
        assert_eq!(
            c.max_live.load(Ordering::SeqCst),
            1,
            "a second value of one key was opened while the first still lived"
        );
        assert_eq!(
            c.opens.load(Ordering::SeqCst),
            c.closes.load(Ordering::SeqCst),
            "one close per open"
        );
        assert_eq!(t.live(), 0);
    }

    #[test]
    fn an_import_during_a_slow_close_waits_for_the_close_then_opens_anew() {
        let t = table();
        let c = Counters::leak();
        let (v, _) = t
            .get_or_open(11, |lease| Ok(c.open(lease, Duration::from_millis(300))))
            .unwrap();
        let dropper = std::thread::spawn(move || drop(v));
        std::thread::sleep(Duration::from_millis(50)); // the close runs now
        let (w, how) = t
            .get_or_open(11, |lease| {
                assert_eq!(
                    c.closes.load(Ordering::SeqCst),
                    1,
                    "opened before the close"
                );
                Ok(c.open(lease, Duration::ZERO))
            })
            .unwrap();
        assert_eq!(how, Served::Opened { waited: true });
        assert_eq!(w.id, 1);
        dropper.join().unwrap();
        // The old value's lease (dropped after its close) did not free the new value's slot.
        let (again, how) = t.get_or_open(11, |_| panic!("must be a hit")).unwrap();
        assert!(Arc::ptr_eq(&again, &w));
        assert_eq!(how, Served::Hit { waited: false });
    }

    #[test]
    fn copied_errors_keep_their_kind_and_text() {
        let os = Error::Os(OsError::new("connect", "/x", rustix::io::Errno::ACCESS));
        let copy = copy_error(&os);
        assert_eq!(copy.to_string(), os.to_string());
        let gone = copy_error(&Error::FdPass(FdPassError::PeerGone { pid: 3 }));
        assert!(matches!(
            gone,
            Error::FdPass(FdPassError::PeerGone { pid: 3 })
        ));
    }
}
