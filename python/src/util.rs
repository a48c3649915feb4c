//! What every class of the extension uses: error and lock helpers, the sliced wait without the
//! GIL, and tensor shaping. The checks of its arguments are in [`crate::args`].

use crate::args::{elements, stream_arg};
use crate::errors::{self, bytes};
use cuda_ipc::channel::ChannelStats;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Whether a close is finishing an object (waiting for its holds, freeing its memory), so that
/// a second `close()` meanwhile returns once that one has, not at once: a re-create of the name
/// after it would find the object still there.
#[derive(Default)]
pub(crate) struct Finish {
    /// The threads whose closes are finishing now: one, or two for the instant in which an
    /// interrupted close has handed the object back and another close has taken it already.
    running: Mutex<Vec<std::thread::ThreadId>>,
    done: Condvar,
}

/// A close finishing ([`Finish::start`]) on a thread; its drop ends it and wakes the `close()`s
/// waiting.
pub(crate) struct Finishing<'a>(&'a Finish, std::thread::ThreadId);

impl Drop for Finishing<'_> {
    fn drop(&mut self) {
        let mut r = lock(&self.0.running);
        if let Some(i) = r.iter().position(|t| *t == self.1) {
            r.swap_remove(i);
        }
        drop(r);
        self.0.done.notify_all();
    }
}

impl Finish {
    /// Marks a close of this thread as finishing until the guard drops. Call it under the lock
    /// whose state says the object is closed (its `state`), so that a second `close()` that
    /// finds it closed finds this too.
    pub(crate) fn start(&self) -> Finishing<'_> {
        let me = std::thread::current().id();
        lock(&self.running).push(me);
        Finishing(self, me)
    }

    /// Whether a close is finishing now.
    pub(crate) fn is_running(&self) -> bool {
        !lock(&self.running).is_empty()
    }

    /// Waits up to `timeout` until no close is finishing: without the GIL, in slices ([`SLICE`]),
    /// a signal handler's exception (Ctrl-C) raised between them. `false` at once when a close of
    /// this thread is finishing: a signal handler's close that interrupted it, which cannot go on
    /// before the handler returns (waiting would only run out the timeout).
    pub(crate) fn wait(&self, py: Python<'_>, timeout: Duration) -> PyResult<bool> {
        let me = std::thread::current().id();
        if lock(&self.running).contains(&me) {
            return Ok(false);
        }
        let deadline = Instant::now().checked_add(timeout);
        loop {
            let slice = match deadline {
                Some(d) => d.saturating_duration_since(Instant::now()).min(SLICE),
                None => SLICE,
            };
            let running = py.detach(|| {
                let r = lock(&self.running);
                !self
                    .done
                    .wait_timeout_while(r, slice, |r| !r.is_empty())
                    .unwrap_or_else(|p| p.into_inner())
                    .0
                    .is_empty()
            });
            if !running || deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(true);
            }
            py.check_signals()?;
        }
    }

    /// What a `close()` that found the object taken by another close does: waits (up to
    /// `timeout`) for the closes finishing it, and returns `true` when the object came back
    /// (`is_back`: a close interrupted by Ctrl-C hands it back, closed but not freed), for the
    /// caller to finish; `false` once it is freed, at the timeout, or at once for a close of a
    /// signal handler that interrupted this thread's own close ([`Finish::wait`]). Several
    /// waiters: the first to see it back takes it, and the others wait for that one's close.
    pub(crate) fn wait_or_take_over(
        &self,
        py: Python<'_>,
        timeout: Duration,
        is_back: impl Fn() -> bool,
    ) -> PyResult<bool> {
        let deadline = Instant::now().checked_add(timeout);
        loop {
            let left = deadline.map_or(timeout, |d| d.saturating_duration_since(Instant::now()));
            if !self.wait(py, left)? {
                return Ok(false);
            }
            if is_back() {
                return Ok(true);
            }
            if !self.is_running() || deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(false);
            }
        }
    }
}

/// The longest a blocking call waits without the GIL before it checks for signals.
pub(crate) const SLICE: Duration = Duration::from_millis(50);

/// The longest `Producer.close()` waits for an `acquire` (and `TensorSetWriter.close()` for a
/// `begin`) blocked in another thread to give the producer (the writer) back; it does so within
/// one [`SLICE`] (plus the time to take the GIL).
pub(crate) const CLOSE_WAITS_FOR_ACQUIRE: Duration = Duration::from_secs(5);

/// How long a writer or producer collected with holds out waits for them (as the Rust drops).
pub(crate) const DROP_WAITS_FOR_HOLDS: Duration = Duration::from_secs(5);

/// Set by the `atexit` hook the module registers at import ([`mark_exiting`]): the interpreter
/// is finalizing. Its threads release no hold from then on, so a writer or producer collected
/// afterwards waits only for other processes' consumers (`close_at_exit`), not its own's.
static EXITING: AtomicBool = AtomicBool::new(false);

/// A writer or producer this process made, closed by the `atexit` hook if it is still open
/// then ([`mark_exiting`]).
pub(crate) trait CloseAtExit: Send + Sync {
    /// Closes it as a process that is exiting does (`close_at_exit`: other processes' holds
    /// waited for, up to `wait`, this process's own forced), if it is idle: one that a thread is
    /// using (a `begin`, an `acquire`, an open update or write frame) is left to that thread.
    fn close_at_exit(&self, py: Python<'_>, wait: Duration);
}

/// Every writer and producer made in this process, as weak references (pruned of the dropped
/// ones at each registration).
static OPEN: Mutex<Vec<std::sync::Weak<dyn CloseAtExit>>> = Mutex::new(Vec::new());

/// The `multiprocessing` finalizer as a Python function ([`mp_exiting`]).
pub(crate) static HOOK: pyo3::sync::PyOnceLock<Py<PyAny>> = pyo3::sync::PyOnceLock::new();

/// The process whose `multiprocessing` finalizers run the hook ([`close_at_exit_later`]).
static MP_HOOKED: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Registers `o` to be closed at the interpreter's exit if it is still open then. Where
/// `multiprocessing` is loaded, the close is registered with its finalizers instead
/// (`multiprocessing.util.Finalize`, exit priority -1, once per process: [`mp_exiting`]): its
/// exit hook runs them after joining the children it started, and a worker it started by fork
/// or forkserver, which ends with `os._exit` (no `atexit` hook), runs them too.
pub(crate) fn close_at_exit_later(py: Python<'_>, o: &std::sync::Arc<dyn CloseAtExit>) {
    {
        let mut open = lock(&OPEN);
        open.retain(|w| w.strong_count() > 0);
        open.push(std::sync::Arc::downgrade(o));
    }
    let pid = std::process::id();
    // Relaxed: a per-process flag used under the GIL (a forked child sees its parent's pid).
    if MP_HOOKED.load(Ordering::Relaxed) == pid {
        return;
    }
    let Some(hook) = HOOK.get(py) else { return };
    let Ok(modules) = py.import("sys").and_then(|s| s.getattr("modules")) else {
        return;
    };
    // Only where it is loaded already: importing it here would cost every process ~5 ms.
    let Ok(util) = modules.get_item("multiprocessing.util") else {
        return;
    };
    let kwargs = pyo3::types::PyDict::new(py);
    let registered = kwargs
        .set_item("exitpriority", -1)
        .and_then(|()| util.getattr("Finalize"))
        .and_then(|f| f.call((py.None(), hook.bind(py)), Some(&kwargs)));
    if registered.is_ok() {
        MP_HOOKED.store(pid, Ordering::Relaxed);
    }
}

/// The `atexit` hook: marks the interpreter as exiting ([`EXITING`]) and closes every writer and
/// producer still open and idle ([`close_all_at_exit`]). Module globals are not collected at the
/// exit while a daemon thread runs (any: one in `time.sleep` is enough), so without this their
/// segments stayed in /dev/shm for `cuda-ipc gc`. Hooks run last registered first, so the
/// user's, registered after `import cuda_ipc`, have run (and closed or released what they do)
/// by then. Where this process registered the close with `multiprocessing`'s finalizers
/// ([`close_at_exit_later`]), it leaves the close to them: `multiprocessing`'s own exit hook,
/// which may run after this one, joins the children it started first (they may still read the
/// sets), then runs [`mp_exiting`].
#[pyfunction]
#[pyo3(name = "_mark_exiting")]
pub(crate) fn mark_exiting(py: Python<'_>) {
    // Relaxed: a flag read by drops that run after the hook on the same thread (finalization),
    // or by any other as a hint only.
    EXITING.store(true, Ordering::Relaxed);
    // Relaxed: as in `close_at_exit_later`.
    if MP_HOOKED.load(Ordering::Relaxed) == std::process::id() {
        return;
    }
    close_all_at_exit(py);
}

/// The `multiprocessing` finalizer ([`close_at_exit_later`], exit priority -1: after its exit
/// hook joined the children it started, and in a worker that ends with `os._exit`): as
/// [`mark_exiting`], closing.
#[pyfunction]
#[pyo3(name = "_mp_exiting")]
pub(crate) fn mp_exiting(py: Python<'_>) {
    // A `multiprocessing` child runs its finalizers as soon as its target returns, before it
    // joins its non-daemon threads (`Process._bootstrap`), which may still be between calls on
    // a writer or producer, or make one: joined here first, as the interpreter's own exit does.
    // (In a process's own exit they were joined before any `atexit` hook: nothing to join.)
    join_other_threads(py);
    // Relaxed: as in `mark_exiting`.
    EXITING.store(true, Ordering::Relaxed);
    close_all_at_exit(py);
}

/// Joins every live non-daemon thread but this one (`threading.enumerate`), as the
/// interpreter's exit does before its `atexit` hooks. A failure to look or join leaves the rest.
fn join_other_threads(py: Python<'_>) {
    let Ok(threading) = py.import("threading") else {
        return;
    };
    let (Ok(me), Ok(all)) = (
        threading.call_method0("current_thread"),
        threading.call_method0("enumerate"),
    ) else {
        return;
    };
    let Ok(all) = all.try_iter() else { return };
    for t in all.flatten() {
        let other = !t.is(&me);
        let daemon = t
            .getattr("daemon")
            .and_then(|d| d.is_truthy())
            .unwrap_or(true);
        if other && !daemon {
            let _ = t.call_method0("join");
        }
    }
}

/// Closes every writer and producer still open and idle ([`CloseAtExit`]), within one budget of
/// [`DROP_WAITS_FOR_HOLDS`] for them all (other processes' holds make the exit wait at most that
/// in all, not that per object).
fn close_all_at_exit(py: Python<'_>) {
    let open: Vec<_> = lock(&OPEN).drain(..).filter_map(|w| w.upgrade()).collect();
    let deadline = Instant::now() + DROP_WAITS_FOR_HOLDS;
    for o in open {
        o.close_at_exit(py, deadline.saturating_duration_since(Instant::now()));
    }
}

/// Lets go of a Rust writer or producer collected idle: its drop (which waits up to 5 s for
/// holds), or once the interpreter is exiting ([`EXITING`]) `close_at_exit`, which waits for
/// other processes' holds only (this process's threads release nothing any more). Without the
/// GIL, so that this process's own threads can release theirs meanwhile (with it they could not
/// run, and the wait always ran to its end); called where the GIL is held (a deallocation).
pub(crate) fn let_go<T: Send>(obj: T, close_at_exit: impl FnOnce(T) + Send) {
    let exiting = EXITING.load(Ordering::Relaxed);
    Python::attach(|py| {
        py.detach(move || {
            if exiting {
                close_at_exit(obj);
            } else {
                drop(obj);
            }
        })
    });
}

/// Copies of at least this many bytes of a host frame run without the GIL.
pub(crate) const COPY_WITHOUT_GIL: usize = 64 * 1024;

/// What a GPU accessor of a host `WriteFrame` raises.
pub(crate) const HOST_WRITE_FRAME: &str = "a host-memory frame has no device buffer, stream or \
                                           DLPack export: write it with write(data, offset) and \
                                           read it with read(offset, n)";
/// What a GPU accessor of a host `Frame` raises.
pub(crate) const HOST_FRAME: &str = "a host-memory frame has no device buffer, stream or DLPack \
                                     export: copy its bytes with bytes() or read(offset, n)";
/// What a host accessor of a GPU frame raises.
pub(crate) const GPU_FRAME: &str = "a GPU frame has no host bytes: use its device buffer (ptr, \
                                    DLPack, __cuda_array_interface__) on its stream";

pub(crate) fn err(py: Python<'_>, e: cuda_ipc::Error) -> PyErr {
    errors::to_py(py, &e)
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The counters of `ChannelStats` as a dict (`consumers`: a list of dicts).
pub(crate) fn stats_dict<'py>(py: Python<'py>, s: &ChannelStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("published", s.published)?;
    d.set_item("head", s.head)?;
    d.set_item("forced_releases", s.forced_releases)?;
    let list = PyList::empty(py);
    for c in &s.consumers {
        let cd = PyDict::new(py);
        cd.set_item("index", c.index)?;
        cd.set_item("pid", c.pid)?;
        cd.set_item("received", c.received)?;
        cd.set_item("dropped", c.dropped)?;
        cd.set_item("in_flight", c.in_flight)?;
        cd.set_item("lag", c.lag)?;
        list.append(cd)?;
    }
    d.set_item("consumers", list)?;
    Ok(d)
}

/// Why one step of a [`sliced`] wait stopped without a value.
pub(crate) enum Stop {
    /// The call failed.
    Failed(cuda_ipc::Error),
    /// The object was closed (by another thread): the caller's closed error.
    Closed,
}

impl From<cuda_ipc::Error> for Stop {
    fn from(e: cuda_ipc::Error) -> Stop {
        Stop::Failed(e)
    }
}

/// Runs `step` (one bounded wait of at most `slice`, without the GIL) until it yields a value, the
/// deadline passes (`Ok(None)`), `closed()` says the object was closed or `step` stops
/// (`Stop::Closed`: the error `closed_error` makes), or a signal handler raises (its exception,
/// e.g. `KeyboardInterrupt`).
///
/// How `close()` from another thread wakes a blocked call: `closed()` is asked before every slice,
/// so the call ends within one slice ([`SLICE`]) of the close, the same bound Ctrl-C has. The
/// slices are futex sleeps in the library (no spinning beyond the wait strategy's), and no lock
/// is held across one, so `close()` never waits for a blocked call to notice. A wake-up through
/// the futex itself would need a cancel word inside the library's wait (shared with Rust
/// callers) for a gain of at most one slice. What a step takes in the slice the close lands in is
/// judged by the step itself, under the object's lock (`Consumer::hand_out`,
/// `Producer::acquire`), which orders it against the close.
pub(crate) fn sliced<T: Send>(
    py: Python<'_>,
    timeout: Option<Duration>,
    closed: impl Fn() -> bool + Sync,
    closed_error: impl FnOnce(Python<'_>) -> PyErr,
    mut step: impl FnMut(Duration) -> Result<Option<T>, Stop> + Send,
) -> PyResult<Option<T>> {
    // `checked_add`: `timeout` is at most `args::MAX_SECONDS`, but the deadline is no bound
    // either way when it overflows.
    let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
    loop {
        let slice = match deadline {
            Some(d) => d.saturating_duration_since(Instant::now()).min(SLICE),
            None => SLICE,
        };
        let got = py.detach(|| {
            if closed() {
                return Err(Stop::Closed);
            }
            step(slice)
        });
        match got {
            Ok(Some(v)) => return Ok(Some(v)),
            Ok(None) => {}
            Err(Stop::Failed(e)) => return Err(err(py, e)),
            Err(Stop::Closed) => return Err(closed_error(py)),
        }
        py.check_signals()?;
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(None);
        }
    }
}

pub(crate) fn timeout_error(py: Python<'_>, what: &'static str, after: Option<Duration>) -> PyErr {
    err(
        py,
        cuda_ipc::Error::Timeout {
            what,
            after: after.unwrap_or_default(),
        },
    )
}

/// The `torch.cuda` stream the update's work runs on: `stream=` if given, else PyTorch's current
/// stream of `device` when PyTorch is imported, else the legacy default stream.
pub(crate) fn work_stream(
    py: Python<'_>,
    stream: Option<&Bound<'_, PyAny>>,
    device: i32,
) -> PyResult<usize> {
    if let Some(s) = stream_arg(py, stream)? {
        return Ok(s);
    }
    let modules = py.import("sys")?.getattr("modules")?;
    if modules.contains("torch")? {
        return crate::tensors::Torch::get(py)?.current_stream(py, device);
    }
    Ok(1)
}

/// `tensor` (a one-dimensional `uint8` tensor of `nbytes` bytes: PyTorch or CuPy) viewed as
/// `dtype` and reshaped to `shape`, using the first `prod(shape) * itemsize` bytes. `itemsize`
/// reads a dtype's element size in that library.
pub(crate) fn shaped<'py>(
    py: Python<'py>,
    tensor: Bound<'py, PyAny>,
    nbytes: usize,
    shape: Option<&Bound<'py, PyAny>>,
    dtype: Option<&Bound<'py, PyAny>>,
    itemsize: impl Fn(&Bound<'py, PyAny>) -> PyResult<usize>,
) -> PyResult<Bound<'py, PyAny>> {
    let size = match dtype {
        Some(d) => itemsize(d)?,
        None => 1,
    };
    let need = match shape {
        Some(s) => {
            let n = elements(py, s)?;
            n.checked_mul(size).ok_or_else(|| {
                errors::invalid_argument(
                    py,
                    format!(
                        "{n} elements of {size} bytes are more than {} bytes (usize::MAX)",
                        usize::MAX
                    ),
                )
            })?
        }
        None => nbytes - nbytes % size.max(1),
    };
    if need > nbytes {
        return Err(errors::invalid_argument(
            py,
            format!(
                "that shape and dtype need {}; the buffer has {nbytes}",
                bytes(need)
            ),
        ));
    }
    let mut t = tensor;
    if need != nbytes {
        t = t.get_item(pyo3::types::PySlice::new(py, 0, need as isize, 1))?;
    }
    if let Some(d) = dtype {
        t = t.call_method1("view", (d,))?;
    }
    if let Some(s) = shape {
        let dims: Vec<usize> = match s.extract::<usize>() {
            Ok(n) => vec![n],
            Err(_) => s.extract()?,
        };
        t = t.call_method1("reshape", (pyo3::types::PyTuple::new(py, dims)?,))?;
    }
    Ok(t)
}

/// A tensor of `obj` (a `Frame` or `WriteFrame`) in PyTorch: `torch.from_dlpack` (which names
/// PyTorch's current stream), then `shaped`.
pub(crate) fn torch_tensor<'py>(
    obj: &Bound<'py, PyAny>,
    nbytes: usize,
    shape: Option<&Bound<'py, PyAny>>,
    dtype: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let py = obj.py();
    let t = py.import("torch")?.call_method1("from_dlpack", (obj,))?;
    shaped(py, t, nbytes, shape, dtype, |d| {
        d.getattr("itemsize")?.extract()
    })
}

/// A CuPy array of `obj`: `cupy.from_dlpack` (which names CuPy's current stream), then `shaped`.
pub(crate) fn cupy_array<'py>(
    obj: &Bound<'py, PyAny>,
    nbytes: usize,
    shape: Option<&Bound<'py, PyAny>>,
    dtype: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let py = obj.py();
    let cupy = py.import("cupy")?;
    let t = cupy.call_method1("from_dlpack", (obj,))?;
    shaped(py, t, nbytes, shape, dtype, |d| {
        cupy.call_method1("dtype", (d,))?
            .getattr("itemsize")?
            .extract()
    })
}

/// Runs `copy` without the GIL when it moves at least [`COPY_WITHOUT_GIL`] bytes.
pub(crate) fn copy<T: Send>(py: Python<'_>, n: usize, copy: impl FnOnce() -> T + Send) -> T {
    if n >= COPY_WITHOUT_GIL {
        py.detach(copy)
    } else {
        copy()
    }
}
