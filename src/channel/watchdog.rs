//! A thread that looks after a channel's peers on behalf of an end whose own thread may be busy
//! (blocked in a stream synchronisation, or in user code): every [`LIVENESS_CHECK`] it runs a
//! check, until the check says it is done or the watchdog is dropped.
//!
//! - A consumer's watchdog closes the gate of a dead producer (`Control::force_ready`), so that
//!   the consumer's stream, waiting for a ready word the producer's stream will never write,
//!   drains within about 20 ms of the death.
//! - A producer's watchdog frees the slots of dead consumers (`Control::reclaim_dead_consumers`),
//!   raising their release words, so that the producer's stream, waiting for a release word a dead
//!   consumer's stream will never write, drains within about 20 ms of the death.

use super::options::LIVENESS_CHECK;
use crate::identity::ForkEpoch;
use std::sync::{Arc, Condvar, Mutex};

/// The running thread; dropping it stops the thread and joins it.
pub(super) struct Watchdog {
    stop: Arc<(Mutex<bool>, Condvar)>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// The process that started the thread: a forked child has no such thread to join
    /// (`identity::fork`).
    fork: ForkEpoch,
}

impl Watchdog {
    /// Starts thread `name` running `check` every [`LIVENESS_CHECK`] until it returns `false`.
    /// When no thread can be started the watchdog is inert (a warning says what is lost: `lost`).
    pub(super) fn start(
        name: &str,
        lost: &str,
        mut check: impl FnMut() -> bool + Send + 'static,
    ) -> Watchdog {
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let s = stop.clone();
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                let (lock, cv) = &*s;
                let mut stopped = lock.lock().unwrap_or_else(|p| p.into_inner());
                while !*stopped {
                    stopped = cv
                        .wait_timeout(stopped, LIVENESS_CHECK)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                    if !*stopped && !check() {
                        return;
                    }
                }
            });
        let thread = match thread {
            Ok(t) => Some(t),
            Err(e) => {
                tracing::warn!("no {name} thread ({e}): {lost}");
                None
            }
        };
        Watchdog {
            stop,
            thread,
            fork: ForkEpoch::now(),
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        if self.fork.inherited() {
            // The thread is the parent's: joining it here would wait for what does not run.
            std::mem::forget(self.thread.take());
            return;
        }
        let (lock, cv) = &*self.stop;
        *lock.lock().unwrap_or_else(|p| p.into_inner()) = true;
        cv.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
