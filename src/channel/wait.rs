//! How the channel waits: a producer's or consumer's [`WaitStrategy`], the wake-up of a futex
//! word ([`bump`]) and the bounded wait on one ([`wait_until`]), which checks its peer every
//! [`LIVENESS_EVERY`]; [`Every`] paces the slower look at whether the channel's name was
//! superseded ([`SUPERSEDED_EVERY`]). Never calls CUDA.

use crate::error::Result;
use crate::shm::futex;
use crate::sync::{AtomicU32, Ordering};
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
    next: Instant,
}

impl Every {
    pub(super) fn new(period: Duration) -> Every {
        Every {
            period,
            next: Instant::now() + period,
        }
    }
    /// `true` at most once per period.
    pub(super) fn due(&mut self) -> bool {
        let now = Instant::now();
        if now >= self.next {
            self.next = now + self.period;
            true
        } else {
            false
        }
    }
}

pub(super) fn bump(word: &AtomicU32) {
    // SYNC POINT: futex. Release: pairs with the Acquire load of the word before a futex wait
    // in `wait_until`; a woken waiter re-checks its condition and sees the change made before
    // this bump.
    word.fetch_add(1, Ordering::Release);
    futex::wake(word, u32::MAX);
}

/// Waits on `word` until `ready()` returns `Some`, the timeout runs out (`Ok(None)`), or
/// `gone()` reports an error (checked every [`LIVENESS_EVERY`]).
pub(super) fn wait_until<T>(
    word: &AtomicU32,
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
        // SYNC POINT: futex. Acquire: pairs with the Release bump in `bump`; read before the
        // condition so a change made after the check is seen as a changed word by the futex
        // wait.
        let seen = word.load(Ordering::Acquire);
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
        futex::wait(word, seen, slice);
    }
}
