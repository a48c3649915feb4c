//! Shared futex words: sleep until a 32-bit word in shared memory changes, wake sleepers on it.
//!
//! The futexes are *shared* (`FUTEX_WAIT`/`FUTEX_WAKE` without `FUTEX_PRIVATE_FLAG`), so a waker in
//! one process reaches a sleeper in another that maps the same page. Every wait has a timeout and
//! every caller re-checks its condition after waking: a wake-up may be spurious, and a waker may
//! have died between changing the word and calling [`wake`].
//!
//! Under `--cfg loom` the calls are modelled: `wait` yields to the model scheduler and returns, and
//! `wake` does nothing, which is what a spurious wake-up and a lost wake-up look like.

use crate::sync::AtomicU32;
use std::time::Duration;

/// What a [`wait`] ended with. In every case the caller re-checks its condition.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum WaitResult {
    /// Woken by [`wake`], by a signal (`EINTR`), or spuriously.
    Woken,
    /// The word did not hold `expected` when the kernel looked (`EAGAIN`): nothing was slept.
    ValueChanged,
    /// The timeout ran out (`ETIMEDOUT`).
    TimedOut,
    /// The call failed with this errno (not expected for a valid word; the call slept up to a
    /// millisecond so a caller retrying in a loop does not spin).
    Failed(i32),
}

/// Sleeps while `word` holds `expected`, for at most `timeout` (`FUTEX_WAIT`, shared).
///
/// `timeout` is relative; a zero timeout checks the word and returns at once.
#[doc(alias = "FUTEX_WAIT")]
#[cfg(not(loom))]
pub fn wait(word: &AtomicU32, expected: u32, timeout: Duration) -> WaitResult {
    use rustix::io::Errno;
    use rustix::thread::futex;
    let ts = rustix::time::Timespec {
        tv_sec: i64::try_from(timeout.as_secs()).unwrap_or(i64::MAX),
        tv_nsec: i64::from(timeout.subsec_nanos()),
    };
    // Flags::empty(): no FUTEX_PRIVATE_FLAG, so the kernel keys the wait on the shared page and a
    // waker in another process finds it.
    match futex::wait(word, futex::Flags::empty(), expected, Some(&ts)) {
        Ok(()) | Err(Errno::INTR) => WaitResult::Woken,
        Err(Errno::AGAIN) => WaitResult::ValueChanged,
        Err(Errno::TIMEDOUT) => WaitResult::TimedOut,
        Err(e) => {
            std::thread::sleep(timeout.min(Duration::from_millis(1)));
            WaitResult::Failed(e.raw_os_error())
        }
    }
}

/// Wakes up to `n` sleepers on `word` (`FUTEX_WAKE`, shared); returns how many were woken.
///
/// Change the word (with `Release`) before calling this, so a sleeper that wakes sees the change.
#[doc(alias = "FUTEX_WAKE")]
#[cfg(not(loom))]
pub fn wake(word: &AtomicU32, n: u32) -> usize {
    use rustix::thread::futex;
    // Shared, as in `wait`. A failure can only come from a bad address, which a reference excludes;
    // sleepers time out and re-check in any case.
    futex::wake(word, futex::Flags::empty(), n.min(i32::MAX as u32)).unwrap_or(0)
}

/// Loom model of `FUTEX_WAIT`: a yield, then a spurious wake-up.
#[cfg(loom)]
pub fn wait(word: &AtomicU32, expected: u32, _timeout: Duration) -> WaitResult {
    use crate::sync::Ordering;
    // Relaxed: the caller re-checks its condition with its own orderings afterwards.
    if word.load(Ordering::Relaxed) != expected {
        return WaitResult::ValueChanged;
    }
    loom::thread::yield_now();
    WaitResult::Woken
}

/// Loom model of `FUTEX_WAKE`: nothing (sleepers model spurious wake-ups).
#[cfg(loom)]
pub fn wake(_word: &AtomicU32, _n: u32) -> usize {
    0
}

/// Wakes every sleeper on `word`.
pub fn wake_all(word: &AtomicU32) -> usize {
    wake(word, i32::MAX as u32)
}
