//! How the channel waits: a producer's or consumer's [`WaitStrategy`], the wake-up of a futex
//! word ([`WakeWord::bump`]) and the bounded wait on one ([`wait_until`]), which checks its peer
//! every [`LIVENESS_EVERY`]; [`Every`] paces the slower look at whether the channel's name was
//! superseded ([`SUPERSEDED_EVERY`]). Never calls CUDA.
//!
//! Each futex word has a sleeper count beside it in the header ([`WakeWord`]): a waiter counts
//! itself, then checks its condition once more, and only then sleeps; a change is followed by a
//! look at the count, and only when it is nonzero by a bump of the word and `FUTEX_WAKE`. So a
//! publish or release that nobody waits for makes no syscall and does not even write the futex
//! word. The count and the waiters' condition are a Dekker pair (SYNC POINT: sleepers), checked by
//! the loom models `loom_channel_wake_*` below.

use super::layout::Header;
use crate::error::Result;
use crate::shm::futex;
use crate::sync::{AtomicU32, Ordering, fence};
use std::time::{Duration, Instant};

/// How a thread waits for a condition on a futex word.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum WaitStrategy {
    /// Sleep on the futex at once (lowest CPU use; wake-up ≈ 10–20 µs).
    Block,
    /// Spin for the given time, then sleep on the futex (the default: 50 µs).
    SpinThenBlock(Duration),
    /// Spin until the timeout (lowest latency, one core busy; wake-up well under 1 µs).
    Spin,
}

impl Default for WaitStrategy {
    fn default() -> Self {
        WaitStrategy::SpinThenBlock(Duration::from_micros(50))
    }
}

/// Liveness is re-checked at least this often while waiting.
pub(super) const LIVENESS_EVERY: Duration = Duration::from_millis(20);
/// How often a waiting producer or consumer looks whether its channel's name was superseded: a
/// `Superseded` error comes within this (plus one liveness period) of the change.
pub(super) const SUPERSEDED_EVERY: Duration = Duration::from_millis(500);

/// A timer for checks that run on a slower cadence than the liveness check.
pub(super) struct Every {
    period: Duration,
    /// `None`: never (`Instant` cannot hold it).
    next: Option<Instant>,
}

impl Every {
    pub(super) fn new(period: Duration) -> Every {
        Every {
            period,
            next: Instant::now().checked_add(period),
        }
    }
    /// `true` at most once per period (never for a period too long for `Instant`).
    pub(super) fn due(&mut self) -> bool {
        let now = Instant::now();
        if self.next.is_some_and(|next| now >= next) {
            self.next = now.checked_add(self.period);
            true
        } else {
            false
        }
    }
}

impl Header {
    /// `publish_futex` and its sleeper count: consumers sleep on it, publish and close bump it.
    pub(super) fn publish_wake(&self) -> WakeWord<'_> {
        WakeWord {
            word: &self.publish_futex,
            sleepers: &self.publish_sleepers,
        }
    }
    /// `release_futex` and its sleeper count: the producer sleeps on it, consumers bump it.
    pub(super) fn release_wake(&self) -> WakeWord<'_> {
        WakeWord {
            word: &self.release_futex,
            sleepers: &self.release_sleepers,
        }
    }
}

/// A futex word and the count of the waiters asleep on it (docs/channel-layout.md, "Futex
/// words"), on plain references to atomics, so that the loom model below runs the same code on
/// heap memory that the channel runs on the mapped segment.
///
/// The Dekker pair (SYNC POINT: sleepers): a waker has made its change (the state the waiters'
/// condition reads) and then loads the count; a waiter stores the count (`fetch_add`), loads the
/// word and then checks its condition. Each side puts a `SeqCst` fence between its store and its
/// loads, so of a change and a waiter about to sleep at least one sees the other: the waiter sees
/// the change (and does not sleep), or the waker sees the waiter counted, bumps the word and wakes
/// it (the waiter's `FUTEX_WAIT` on the word it read before its check then returns at once, or is
/// woken).
///
/// A waiter killed while counted leaves the count too high for good: every later bump then makes
/// a `FUTEX_WAKE` that wakes nobody, which costs a syscall and breaks nothing. The count is never
/// too low, since only a waiter that counted itself takes itself off.
#[derive(Clone, Copy)]
pub(crate) struct WakeWord<'a> {
    /// `publish_futex` or `release_futex`.
    pub(crate) word: &'a AtomicU32,
    /// `publish_sleepers` or `release_sleepers`.
    pub(crate) sleepers: &'a AtomicU32,
}

/// The two futex calls, so that the loom model can stand in for the kernel's.
pub(crate) trait Futex {
    /// `FUTEX_WAIT(word, expected, timeout)`: returns at once if `word` is not `expected`, else
    /// sleeps until a wake (or the timeout, or spuriously).
    fn wait(&self, word: &AtomicU32, expected: u32, timeout: Duration);
    /// `FUTEX_WAKE(word, INT_MAX)`.
    fn wake(&self, word: &AtomicU32);
}

/// The kernel's shared futex (`crate::shm::futex`).
pub(crate) struct Kernel;

impl Futex for Kernel {
    fn wait(&self, word: &AtomicU32, expected: u32, timeout: Duration) {
        // Every outcome (woken, value changed, timed out, failed) ends in the caller's re-check.
        let _ = futex::wait(word, expected, timeout);
    }
    fn wake(&self, word: &AtomicU32) {
        let _woken = futex::wake(word, u32::MAX);
        #[cfg(test)]
        WAKES.with(|w| {
            let (calls, woken) = w.get();
            w.set((calls + 1, woken + _woken as u64));
        });
    }
}

impl WakeWord<'_> {
    /// Announces a change made just before: when a waiter is counted as (about to be) asleep,
    /// `fetch_add(word, 1)` and `FUTEX_WAKE`; otherwise nothing is written.
    pub(crate) fn bump(&self) {
        self.bump_on(&Kernel);
    }

    /// [`WakeWord::bump`] on the futex `f`.
    pub(crate) fn bump_on(&self, f: &impl Futex) {
        // SYNC POINT: sleepers. A SeqCst fence after the change, then the count: the waker half
        // of the Dekker pair with `sleep_on`. A waiter counted before the fence is seen below and
        // woken; one counted after it sees the change in its condition check and does not sleep.
        fence(Ordering::SeqCst);
        // SYNC POINT: sleepers. SeqCst: no waiter counted means none sleeps, or will, unaware of
        // the change.
        if self.sleepers.load(Ordering::SeqCst) != 0 {
            // SYNC POINT: futex. SeqCst: pairs with the waiter's load of the word in `sleep_on`;
            // a waiter that read the old word sleeps on it and is woken below, or finds it
            // changed and does not sleep.
            self.word.fetch_add(1, Ordering::SeqCst);
            f.wake(self.word);
        }
    }

    /// Counted as a sleeper, checks `ready` once more and, when it is still not ready, sleeps on
    /// the word for at most `timeout`. Returns what `ready` gave; the caller checks again after a
    /// sleep.
    pub(crate) fn sleep_on<T>(
        &self,
        f: &impl Futex,
        timeout: Duration,
        ready: &mut impl FnMut() -> Result<Option<T>>,
    ) -> Result<Option<T>> {
        // SYNC POINT: sleepers. SeqCst, then a SeqCst fence: the waiter half of the Dekker pair
        // with `bump_on`. A waker whose fence comes after this one sees the count and wakes.
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        // SYNC POINT: futex. SeqCst, before the condition: a bump made after this load changes
        // the word, so the sleep below does not miss it.
        let seen = self.word.load(Ordering::SeqCst);
        // A change whose fence came before ours is seen here.
        let got = ready();
        if matches!(got, Ok(None)) {
            f.wait(self.word, seen, timeout);
        }
        // Relaxed: taking itself off orders nothing; a waker that still sees the count makes a
        // wake that finds nobody, which is harmless.
        self.sleepers.fetch_sub(1, Ordering::Relaxed);
        got
    }
}

/// Waits on `wake`'s word until `ready()` returns `Some`, the timeout runs out (`Ok(None)`), or
/// `gone()` reports an error (checked every [`LIVENESS_EVERY`]).
pub(super) fn wait_until<T>(
    wake: WakeWord<'_>,
    strategy: WaitStrategy,
    timeout: Option<Duration>,
    mut ready: impl FnMut() -> Result<Option<T>>,
    mut gone: impl FnMut() -> Result<()>,
) -> Result<Option<T>> {
    let start = Instant::now();
    let mut last_check = start;
    let spin_for = match strategy {
        WaitStrategy::Block => Duration::ZERO,
        WaitStrategy::SpinThenBlock(d) => d,
        WaitStrategy::Spin => Duration::MAX,
    };
    loop {
        if let Some(v) = ready()? {
            return Ok(Some(v));
        }
        let now = Instant::now();
        let waited = now - start;
        if timeout.is_some_and(|t| waited >= t) {
            return Ok(None);
        }
        if now - last_check >= LIVENESS_EVERY {
            gone()?;
            last_check = now;
        }
        if waited < spin_for {
            std::hint::spin_loop();
            continue;
        }
        let mut slice = LIVENESS_EVERY;
        if let Some(t) = timeout {
            slice = slice.min(t.saturating_sub(waited));
        }
        if let Some(v) = wake.sleep_on(&Kernel, slice, &mut ready)? {
            return Ok(Some(v));
        }
    }
}

#[cfg(test)]
thread_local! {
    /// `FUTEX_WAKE` calls made by this thread's bumps, and the sleepers they woke.
    static WAKES: std::cell::Cell<(u64, u64)> = const { std::cell::Cell::new((0, 0)) };
}

/// (calls, woken) of this thread's `FUTEX_WAKE`s since the last call of this.
#[cfg(test)]
pub(super) fn take_wakes() -> (u64, u64) {
    WAKES.with(|w| w.replace((0, 0)))
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_period_too_long_for_an_instant_is_never_due_and_does_not_panic() {
        let mut never = Every::new(Duration::MAX);
        assert!(!never.due(), "a period of Duration::MAX came due");
        let mut now = Every::new(Duration::ZERO);
        assert!(now.due(), "a period of zero was not due at once");
        assert!(now.due(), "a period of zero was not due again");
    }

    #[test]
    fn a_bump_with_no_sleeper_makes_no_futex_wake() {
        let (word, sleepers) = (AtomicU32::new(0), AtomicU32::new(0));
        let w = WakeWord {
            word: &word,
            sleepers: &sleepers,
        };
        take_wakes();
        for _ in 0..1000 {
            w.bump();
        }
        assert_eq!(
            word.load(Ordering::Relaxed),
            0,
            "a bump nobody waits for wrote the word"
        );
        assert_eq!(
            take_wakes(),
            (0, 0),
            "a bump nobody waits for made a syscall"
        );
        // A count left by a waiter killed while counted: every bump then wakes, finding nobody
        // (a spurious syscall, never a lost wake-up).
        sleepers.store(1, Ordering::Relaxed);
        w.bump();
        assert_eq!(take_wakes(), (1, 0));
    }

    #[test]
    fn a_sleeping_waiter_is_woken_promptly() {
        // The waiter sleeps in slices of LIVENESS_EVERY: a lost wake-up would show as a wait of
        // up to a slice and as a FUTEX_WAKE that found nobody. A wake that lands between two
        // slices finds nobody too without being lost, so a few tries are allowed.
        for _ in 0..20 {
            let (word, sleepers, flag) = (AtomicU32::new(0), AtomicU32::new(0), AtomicU32::new(0));
            let w = WakeWord {
                word: &word,
                sleepers: &sleepers,
            };
            let (latency, woken) = std::thread::scope(|s| {
                let waiter = s.spawn(|| {
                    wait_until(
                        w,
                        WaitStrategy::Block,
                        Some(Duration::from_secs(10)),
                        || Ok((flag.load(Ordering::Acquire) == 1).then_some(())),
                        || Ok(()),
                    )
                    .unwrap()
                    .expect("the waiter timed out");
                    Instant::now()
                });
                while sleepers.load(Ordering::SeqCst) == 0 {
                    std::thread::yield_now();
                }
                std::thread::sleep(Duration::from_millis(2));
                flag.store(1, Ordering::Release);
                take_wakes();
                let t0 = Instant::now();
                w.bump();
                let (_, woken) = take_wakes();
                (waiter.join().unwrap() - t0, woken)
            });
            assert_eq!(
                sleepers.load(Ordering::SeqCst),
                0,
                "the waiter stayed counted"
            );
            if woken == 1 && latency < LIVENESS_EVERY / 2 {
                return;
            }
        }
        panic!("no try woke the sleeping waiter promptly");
    }
}

#[cfg(all(test, loom))]
mod loom_model {
    //! Model of the sleep and wake-up on one futex word ([`WakeWord`]): waiters check a
    //! condition and sleep, a waker makes it true and bumps. The futex stands in for the
    //! kernel's: a wait returns at once if the word changed, else blocks until a wake (no
    //! timeout, no spurious wake-up). A lost wake-up leaves a waiter blocked for good, which loom
    //! reports as a deadlock.
    use super::*;
    use loom::sync::{Arc, Condvar, Mutex};

    /// The kernel's futex on one word: the hash bucket's lock, and the wakes made under it.
    struct ModelFutex {
        wakes: Mutex<u64>,
        woken: Condvar,
    }

    impl Futex for ModelFutex {
        fn wait(&self, word: &AtomicU32, expected: u32, _timeout: Duration) {
            let mut wakes = self.wakes.lock().unwrap();
            // Relaxed: read under the lock, as the kernel reads the word under its bucket lock;
            // a change made before a waker took the lock is seen.
            if word.load(Ordering::Relaxed) != expected {
                return;
            }
            let at = *wakes;
            while *wakes == at {
                wakes = self.woken.wait(wakes).unwrap();
            }
        }
        fn wake(&self, _word: &AtomicU32) {
            *self.wakes.lock().unwrap() += 1;
            self.woken.notify_all();
        }
    }

    struct Shared {
        word: AtomicU32,
        sleepers: AtomicU32,
        /// The waiters' condition (what a publish or release changes).
        ready: AtomicU32,
        futex: ModelFutex,
    }

    impl Shared {
        fn new(stale_sleepers: u32) -> Arc<Self> {
            Arc::new(Shared {
                word: AtomicU32::new(0),
                sleepers: AtomicU32::new(stale_sleepers),
                ready: AtomicU32::new(0),
                futex: ModelFutex {
                    wakes: Mutex::new(0),
                    woken: Condvar::new(),
                },
            })
        }
        fn wake_word(&self) -> WakeWord<'_> {
            WakeWord {
                word: &self.word,
                sleepers: &self.sleepers,
            }
        }
        /// `wait_until`'s loop without the clock: the condition, then a sleep that checks it
        /// once more while counted.
        fn wait(&self) {
            let mut ready = || Ok((self.ready.load(Ordering::Acquire) == 1).then_some(()));
            loop {
                if ready().unwrap().is_some() {
                    return;
                }
                if self
                    .wake_word()
                    .sleep_on(&self.futex, LIVENESS_EVERY, &mut ready)
                    .unwrap()
                    .is_some()
                {
                    return;
                }
            }
        }
        /// A publish or release: the change, then the bump.
        fn change(&self) {
            self.ready.store(1, Ordering::Release);
            self.wake_word().bump_on(&self.futex);
        }
    }

    fn builder() -> loom::model::Builder {
        let mut b = loom::model::Builder::new();
        b.preemption_bound = Some(3);
        b
    }

    #[test]
    fn loom_channel_wake_a_waiter_that_sleeps_is_woken_or_sees_the_change() {
        builder().check(|| {
            let s = Shared::new(0);
            let w = s.clone();
            let waiter = loom::thread::spawn(move || w.wait());
            s.change();
            waiter.join().unwrap();
            assert_eq!(s.sleepers.load(Ordering::Relaxed), 0);
        });
    }

    #[test]
    fn loom_channel_wake_two_waiters_are_both_woken_by_one_bump() {
        builder().check(|| {
            let s = Shared::new(0);
            let waiters: Vec<_> = (0..2)
                .map(|_| {
                    let w = s.clone();
                    loom::thread::spawn(move || w.wait())
                })
                .collect();
            s.change();
            for w in waiters {
                w.join().unwrap();
            }
            assert_eq!(s.sleepers.load(Ordering::Relaxed), 0);
        });
    }

    #[test]
    fn loom_channel_wake_a_stale_count_of_a_killed_waiter_loses_no_wake_up() {
        builder().check(|| {
            // A waiter killed while counted left 1 behind.
            let s = Shared::new(1);
            let w = s.clone();
            let waiter = loom::thread::spawn(move || w.wait());
            s.change();
            waiter.join().unwrap();
            assert_eq!(s.sleepers.load(Ordering::Relaxed), 1);
            // The bump saw the stale count and woke (nobody, or the waiter).
            assert_eq!(*s.futex.wakes.lock().unwrap(), 1);
        });
    }
}
