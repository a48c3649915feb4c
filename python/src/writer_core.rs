//! What a Python `TensorSetWriter` (`tensor_set_writer.rs`) shares with its open `TensorUpdate`
//! (`tensor_update.rs`): the Rust writer while no update has it, how `close()` meets the call
//! that has it, and the set's name, layout and dicts of writable tensors.

use crate::errors;
use crate::sources;
use crate::tensors;
use crate::util::{Finish, err, lock};
use cuda_ipc::channel::MemoryKind;
use cuda_ipc::identity::ForkEpoch;
use cuda_ipc::tensorset::Layout;
use cuda_ipc::tensorset::owned::OwnedUpdate;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple};
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::Duration;

pub(crate) type RustWriter = cuda_ipc::tensorset::TensorSetWriter;

/// What a writer holds between updates: the Rust writer, or nothing while an update owns it.
pub(crate) enum Slot {
    Idle(Box<RustWriter>),
    Updating,
    Closed,
}

/// The writer's [`Slot`] and how a `close()` meets the call that has the Rust writer: in one lock,
/// so that a close and a `begin`'s hand-out of its update are ordered (the close either came
/// first, and the `begin` raises `TensorSetClosed`, or it finds the update and aborts it).
pub(crate) struct State {
    pub(crate) slot: Slot,
    /// The thread of the `begin` that has the writer while it waits for a buffer.
    pub(crate) beginning: Option<std::thread::ThreadId>,
    /// `close()` was called (with this `timeout`) while another call had the writer: a `begin`
    /// stops before its next slice; the writer is closed when it comes back (`give_back`).
    pub(crate) closing: Option<Duration>,
    /// A `close()` waits (`back`) for that `begin` to give the writer back, and closes it.
    pub(crate) close_waits: bool,
}

/// What a `TensorSetWriter` and its `TensorUpdate`s share (the update keeps it alive while
/// open): the Rust writer between updates and the Python-side caches of the set.
pub(crate) struct WriterCore {
    pub(crate) state: Mutex<State>,
    /// Notified whenever the Rust writer comes back to `state`: a `close()` waiting for a `begin`
    /// of another thread (`State::close_waits`) waits on it.
    pub(crate) back: Condvar,
    /// The set's name, layout, CUDA device ordinal, and whether it lives in host memory.
    pub(crate) name: String,
    pub(crate) layout: Arc<Layout>,
    pub(crate) device: i32,
    pub(crate) host: bool,
    /// The last generation committed.
    pub(crate) generation: Mutex<u64>,
    /// For `over_tensors`: the published tensors, kept alive while the set is (their memory must
    /// not go back to PyTorch's pool while readers map it).
    _keep: Option<Py<PyDict>>,
    /// The open update's cell (shared with its `TensorUpdate`), so `close()` can abort it.
    pub(crate) open: Mutex<Weak<Mutex<Option<OwnedUpdate>>>>,
    /// The tensors' names as `str`s and the name → index dict over them, made at first use.
    pub(crate) names: PyOnceLock<Py<PyTuple>>,
    pub(crate) index: PyOnceLock<Py<PyDict>>,
    /// Each buffer's dict of writable tensors, built at its first `TensorUpdate.tensors()`;
    /// dropped at `close()`.
    pub(crate) dicts: Mutex<HashMap<usize, Py<PyDict>>>,
    /// The process (by fork) that made the writer: a forked child's calls raise `NotSupported`
    /// before taking `state`, which a thread of the parent may have held at the fork.
    pub(crate) fork: ForkEpoch,
    /// Takes the set's generations from readers at the start of `close()`, also while a `begin`
    /// of another thread has the Rust writer (which then gives it back within a slice).
    pub(crate) closer: cuda_ipc::tensorset::Closer,
    /// Set while a close frees the set: a second `close()` returns once it has.
    pub(crate) finish: Finish,
}

/// `TensorSetClosed` for set `name`.
pub(crate) fn closed_error(py: Python<'_>, name: &str) -> PyErr {
    err(
        py,
        cuda_ipc::tensorset::TensorSetError::Closed(name.to_string()).into(),
    )
}

impl Drop for WriterCore {
    fn drop(&mut self) {
        // Collected with the writer idle: the Rust writer's drop waits up to 5 s for readers'
        // holds before it frees the memory (`let_go`). The Python objects sharing this core are
        // deallocated with the GIL held.
        let slot = std::mem::replace(
            &mut self.state.get_mut().unwrap_or_else(|p| p.into_inner()).slot,
            Slot::Closed,
        );
        if let Slot::Idle(w) = slot {
            // A failed sync of the writer's stream has no caller left to go to; the memory is
            // freed all the same.
            crate::util::let_go(w, |w| {
                let _ = w.close_at_exit(crate::util::DROP_WAITS_FOR_HOLDS);
            });
        }
    }
}

impl crate::util::CloseAtExit for WriterCore {
    fn close_at_exit(&self, py: Python<'_>, wait: Duration) {
        if self.fork.inherited() {
            return; // a forked child's copy: the parent's set
        }
        let taken = {
            let mut s = lock(&self.state);
            match std::mem::replace(&mut s.slot, Slot::Closed) {
                Slot::Idle(w) => Some((w, self.finish.start())),
                other => {
                    s.slot = other;
                    None
                }
            }
        };
        if let Some((w, _finishing)) = taken {
            py.detach(|| {
                self.closer.withdraw();
                // A failed sync of the writer's stream has no caller left to go to; the memory
                // is freed all the same.
                let _ = w.close_at_exit(wait);
            });
        }
    }
}

impl WriterCore {
    pub(crate) fn new(w: RustWriter, device: i32, keep: Option<Py<PyDict>>) -> WriterCore {
        WriterCore {
            closer: w.closer(),
            name: w.name().to_string(),
            layout: Arc::new(w.layout().clone()),
            host: w.memory_kind() == MemoryKind::Host,
            generation: Mutex::new(w.generation()),
            state: Mutex::new(State {
                slot: Slot::Idle(Box::new(w)),
                beginning: None,
                closing: None,
                close_waits: false,
            }),
            back: Condvar::new(),
            device,
            _keep: keep,
            open: Mutex::new(Weak::new()),
            names: PyOnceLock::new(),
            index: PyOnceLock::new(),
            finish: Finish::default(),
            dicts: Mutex::new(HashMap::new()),
            fork: ForkEpoch::now(),
        }
    }

    /// The name → index dict of the set's tensors, made at the first call.
    pub(crate) fn index<'py>(&self, py: Python<'py>) -> PyResult<&Bound<'py, PyDict>> {
        Ok(self
            .index
            .get_or_try_init(py, || sources::index_dict(py, self.name_strs(py)?))?
            .bind(py))
    }

    pub(crate) fn name_strs<'py>(&self, py: Python<'py>) -> PyResult<&Bound<'py, PyTuple>> {
        Ok(self
            .names
            .get_or_try_init(py, || tensors::name_strings(py, &self.layout))?
            .bind(py))
    }

    /// `NotSupported` naming `what` (the writer, or its update) in a process forked from the one
    /// that made the writer: before `state` or an update's cell is locked (a thread of the parent
    /// may have held either at the fork), before PyTorch is asked for a stream (its CUDA does not
    /// survive the fork either).
    pub(crate) fn check_fork(&self, what: &'static str) -> PyResult<()> {
        errors::check_fork(self.fork, what)
    }

    /// Takes the Rust writer out for a `begin` of this thread.
    pub(crate) fn take(&self, py: Python<'_>) -> PyResult<Box<RustWriter>> {
        self.check_fork("tensor set writer")?;
        let mut s = lock(&self.state);
        if s.closing.is_some() {
            return Err(closed_error(py, &self.name));
        }
        match std::mem::replace(&mut s.slot, Slot::Updating) {
            Slot::Idle(w) => {
                s.beginning = Some(std::thread::current().id());
                Ok(w)
            }
            Slot::Updating => {
                let what = if s.beginning.is_some() {
                    "another thread waits in begin() of this tensor set"
                } else {
                    "an update of this tensor set is open: commit or abort it first"
                };
                Err(errors::invalid_argument(py, what.to_string()))
            }
            Slot::Closed => {
                s.slot = Slot::Closed;
                Err(closed_error(py, &self.name))
            }
        }
    }

    /// Whether `close()` was called while a call had the writer (a `begin` stops then).
    pub(crate) fn is_closing(&self) -> bool {
        lock(&self.state).closing.is_some()
    }

    /// Whether the writer is closed, or `close()` was called and closes it once the call that
    /// has it gives it back.
    pub(crate) fn is_closed(&self) -> bool {
        let s = lock(&self.state);
        matches!(s.slot, Slot::Closed) || s.closing.is_some()
    }

    /// Takes the Rust writer back from a `begin` or an update. Once `close()` was called
    /// meanwhile, it is closed here, with the GIL released, unless that `close()` waits for it (a
    /// `close()` from another thread than a waiting `begin`'s): it closes it. So the set is
    /// closed exactly once, by the one who holds the writer.
    pub(crate) fn give_back(&self, py: Python<'_>, w: Box<RustWriter>) {
        *lock(&self.generation) = w.generation();
        let mut s = lock(&self.state);
        s.beginning = None;
        if let Some(t) = s.closing.filter(|_| !s.close_waits) {
            s.slot = Slot::Closed;
            // A `close()` that finds the slot closed now waits for this close to finish.
            let _finishing = self.finish.start();
            drop(s);
            // Nobody is left to tell of a failure: as the Rust writer's `Drop`, which logs it.
            py.detach(|| drop(w.close(t)));
            return;
        }
        s.slot = Slot::Idle(w);
        drop(s);
        self.back.notify_all();
    }
}
