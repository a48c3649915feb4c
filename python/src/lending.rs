//! The Rust producer of a Python `Producer`, and how it is lent: by value to a blocking
//! `acquire` and then to the `WriteFrame` it returns, and back when they end. It is closed (and
//! dropped) by whoever holds it once `close()` was called, so it is never dropped while in use:
//! see [`Lender::give_back`]. Shared (`Arc`) by the `Producer` and its `WriteFrame`s.

use crate::errors;
use crate::util::{Finish, SLICE, lock};
use cuda_ipc::identity::ForkEpoch;
use pyo3::prelude::*;
use std::sync::{Condvar, Mutex};
use std::time::Duration;

pub(crate) type RustProducer = cuda_ipc::channel::Producer;

/// A channel's Rust producer and the state of its loan.
pub(crate) struct Lender {
    pub(crate) state: Mutex<ProducerState>,
    /// Notified whenever the Rust producer comes back to `state`: a `close()` waiting for an
    /// `acquire` of another thread (`ProducerState::close_waits`) waits on it.
    pub(crate) back: Condvar,
    /// The channel's name.
    pub(crate) name: String,
    /// The `stream=` option: every write frame's publish is ordered after it.
    pub(crate) stream: Option<usize>,
    /// The process (by fork) that created the channel: a forked child's calls raise
    /// `NotSupported` before taking `state`, which a thread of the parent may have held.
    fork: ForkEpoch,
    /// Set while a close frees the channel: a second `close()` returns once it has.
    pub(crate) finish: Finish,
}

/// What [`Lender::state`] guards, in one lock so that a close and a hand-back are ordered.
pub(crate) struct ProducerState {
    /// `None` while an `acquire` or a `WriteFrame` has it, and after `close()`.
    pub(crate) producer: Option<Box<RustProducer>>,
    /// `close()` was called: blocking calls stop, the producer is closed when it comes back.
    pub(crate) closed: bool,
    /// The thread of the `acquire` that has the producer, while one does.
    pub(crate) acquiring: Option<std::thread::ThreadId>,
    /// A `close()` waits (`back`) for that `acquire` to give the producer back; it closes it.
    pub(crate) close_waits: bool,
    /// The `timeout` of `close()`, for a producer that comes back after it.
    pub(crate) close_timeout: Duration,
}

impl Drop for Lender {
    fn drop(&mut self) {
        // Collected with the producer idle: the Rust producer's drop waits up to 5 s for
        // consumers' holds (`let_go`). The Python objects sharing this are deallocated with the
        // GIL held.
        let producer = self
            .state
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .producer
            .take();
        if let Some(p) = producer {
            // A failed sync of the producer's stream has no caller left to go to; the pool is
            // freed all the same.
            crate::util::let_go(p, |p| {
                let _ = p.close_at_exit(crate::util::DROP_WAITS_FOR_HOLDS);
            });
        }
    }
}

impl crate::util::CloseAtExit for Lender {
    fn close_at_exit(&self, py: Python<'_>, wait: Duration) {
        if self.fork.inherited() {
            return; // a forked child's copy: the parent's channel
        }
        let taken = {
            let mut s = lock(&self.state);
            let p = s.producer.take();
            // Closed only when taken here: a producer lent out is its thread's to give back.
            s.closed |= p.is_some();
            p.map(|p| (p, self.finish.start()))
        };
        if let Some((p, _finishing)) = taken {
            // A failed sync of the producer's stream has no caller left to go to; the pool is
            // freed all the same.
            py.detach(|| drop(p.close_at_exit(wait)));
        }
    }
}

impl Lender {
    /// Lends nothing yet: `p` is at home.
    pub(crate) fn new(p: RustProducer, name: String, stream: Option<usize>) -> Lender {
        Lender {
            state: Mutex::new(ProducerState {
                producer: Some(Box::new(p)),
                closed: false,
                acquiring: None,
                close_waits: false,
                close_timeout: Duration::ZERO,
            }),
            back: Condvar::new(),
            name,
            stream,
            fork: ForkEpoch::now(),
            finish: Finish::default(),
        }
    }

    /// Whether this is a forked child's copy of its parent's producer ([`ForkEpoch::inherited`]).
    pub(crate) fn is_forked_copy(&self) -> bool {
        self.fork.inherited()
    }

    /// `NotSupported` in a forked child's copy, before `state` is locked (a thread of the parent
    /// may have held it at the fork).
    pub(crate) fn check_fork(&self) -> PyResult<()> {
        errors::check_fork(self.fork, "channel producer")
    }

    /// Lends the Rust producer out (to an `acquire` of this thread when `acquiring`).
    pub(crate) fn take(&self, py: Python<'_>, acquiring: bool) -> PyResult<Box<RustProducer>> {
        self.check_fork()?;
        let mut s = lock(&self.state);
        if s.closed {
            return Err(self.closed_error());
        }
        let Some(p) = s.producer.take() else {
            return Err(errors::invalid_argument(
                py,
                "the producer is in use: a WriteFrame of it is outstanding (publish or abandon \
                 it first), or another thread is in acquire()"
                    .to_string(),
            ));
        };
        if acquiring {
            s.acquiring = Some(std::thread::current().id());
        }
        Ok(p)
    }

    /// Before an awaitable's `acquire`: an `acquire_async` cancelled a moment ago may still have
    /// the producer (its thread stops within a slice, [`crate::util::SLICE`]); waits up to two
    /// slices for it to come back, so that awaiting again right after a cancellation does not
    /// find the producer in use. Returns at once when no `acquire` has it.
    pub(crate) fn await_cancelled_acquire(&self, py: Python<'_>) {
        py.detach(|| {
            let s = lock(&self.state);
            drop(
                self.back
                    .wait_timeout_while(s, 2 * SLICE, |s| {
                        !s.closed && s.producer.is_none() && s.acquiring.is_some()
                    })
                    .unwrap_or_else(|p| p.into_inner()),
            );
        });
    }

    /// `ChannelClosed`: what every call raises once `close()` was called.
    pub(crate) fn closed_error(&self) -> PyErr {
        errors::ChannelClosed::new_err(format!("the producer of channel {:?} is closed", self.name))
    }

    pub(crate) fn is_closed(&self) -> bool {
        lock(&self.state).closed
    }

    /// Takes the Rust producer back from an `acquire` (`from_acquire`) or a `WriteFrame`. Once
    /// `close()` was called, it is closed here, with the GIL released, unless that `close()`
    /// waits for it (a `close()` from another thread than a blocked `acquire`'s): it closes it.
    /// So the channel is closed exactly once, by the one who holds the producer.
    pub(crate) fn give_back(&self, py: Python<'_>, p: Box<RustProducer>, from_acquire: bool) {
        let mut s = lock(&self.state);
        if from_acquire {
            s.acquiring = None;
        }
        if s.closed && !s.close_waits {
            let t = s.close_timeout;
            // A `close()` that finds the producer gone now waits for this close to finish.
            let _finishing = self.finish.start();
            drop(s);
            // Nobody is left to tell of a failure: as the Rust producer's `Drop`, which logs it.
            py.detach(|| drop(p.close(t)));
            return;
        }
        s.producer = Some(p);
        drop(s);
        self.back.notify_all();
    }
}
