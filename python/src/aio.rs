//! Awaitable waits for asyncio programs: a blocking wait of the extension (`recv`, `acquire`,
//! `Posted.wait`) as a coroutine that runs it on a thread of the extension's own executor (one per
//! process, a thread for every wait pending at once: it waits without the GIL), so the loop goes
//! on meanwhile, and stops it when the awaiting task is cancelled. Not the loop's default
//! executor: that one has `min(32, cpus + 4)` threads, and as many waits pending there (receives
//! waiting for a producer awaited in the same loop) would keep every later wait from starting, its
//! own timeout included: a deadlock. A coroutine, not a bare future, so that nothing waits before
//! it is awaited (a future made and never awaited would keep a thread waiting, and the
//! interpreter's exit, which joins the executor's threads, waiting for it) and
//! `asyncio.create_task` takes it.
//!
//! How a cancellation reaches the thread: the future `run_in_executor` returns gets a done
//! callback ([`AsyncWait::_done`]) that raises the job's `cancelled` flag; the wait checks the
//! flag between its slices of at most [`crate::util::SLICE`] (as it checks `close()`), so the
//! thread ends within one slice of the cancellation, and the interpreter's exit, which joins the
//! executor's threads, never waits longer for one that was cancelled. What the wait took in the
//! slice the cancellation lands in (a buffer) is dropped with the discarded result: a buffer goes
//! back unpublished (at once: the coroutine's `undo`, or the wait itself when it sees the
//! cancellation after taking it, abandons the frame, so that an `acquire` awaited right after
//! finds the producer free). A receive or a tensor-set wait loses nothing that way: a posted
//! receive's wait
//! ([`awaitable_then`]) parks the frame on the `Posted` object and the coroutine, if still
//! awaited, claims it, otherwise the next wait does; `Consumer.recv_async`
//! ([`awaitable_parking`]) parks it on the consumer, and a frame whose coroutine was cancelled
//! ([`AsyncWait::_done`] raises the job's `abandoned` flag) goes to the consumer's next receive.
//! `TensorSetReader.wait_newer_async` parks the generation's hold on the reader the same way, for
//! the reader's next take. A job dropped with its coroutine (however that ended) raises the flag
//! too: what it parked and nobody claimed goes to the next waiter.

use crate::util::lock;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// The wait a job runs, once: it is passed the job's cancellation flag, to stop at.
type Wait = Box<dyn FnOnce(Python<'_>, &AtomicBool) -> PyResult<Py<PyAny>> + Send>;

/// One awaitable wait: called by the executor's thread (`__call__`), told by the future's done
/// callback (`_done`) when the awaiting side no longer wants the result.
#[pyclass(module = "cuda_ipc", frozen)]
pub(crate) struct AsyncWait {
    /// Raised by `_done`; read by the wait between slices. Relaxed on both sides: it orders no
    /// other memory (what the wait took is judged under the object's own lock, not by the flag).
    cancelled: AtomicBool,
    /// Raised by `_done` when the future was cancelled: the coroutine will not claim what the
    /// wait parks ([`awaitable_parking`]). Shared with the wait, which hands it on with the frame
    /// it parks.
    abandoned: Arc<AtomicBool>,
    /// The wait, taken by the one `__call__`.
    wait: Mutex<Option<Wait>>,
}

#[pymethods]
impl AsyncWait {
    /// Runs the wait (in the executor's thread); a second call raises `RuntimeError`.
    fn __call__(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let Some(wait) = lock(&self.wait).take() else {
            return Err(pyo3::exceptions::PyRuntimeError::new_err(
                "this wait already ran",
            ));
        };
        wait(py, &self.cancelled)
    }

    /// Whether the awaiting side's future is done (`_done` came): read by the executor's thread
    /// once the wait returned, when only a cancellation (or the loop's end) can have done it.
    fn _gave_up(&self) -> bool {
        is_cancelled(&self.cancelled)
    }

    /// Called by the coroutine when its task was cancelled after the wait finished (the future
    /// done, not cancelled, so `_done` raised no abandonment): what the wait parked is for the
    /// next waiter.
    fn _abandon(&self) {
        // Release: pairs with the Acquire load in `is_abandoned`, as in `_done`.
        self.abandoned.store(true, Ordering::Release);
    }

    /// The future's done callback: the wait stops within a slice if it still runs (it does only
    /// when the future was cancelled, or the loop closed, before the result came).
    fn _done(&self, future: &Bound<'_, PyAny>) {
        // Before `cancelled`: a wait that stops at the flag has the abandonment to hand on.
        let gave_up = future
            .call_method0("cancelled")
            .and_then(|c| c.is_truthy())
            .unwrap_or(true);
        if gave_up {
            // Release: pairs with the Acquire load in `is_abandoned`; orders nothing else (the
            // parked frame is handed over under its own lock).
            self.abandoned.store(true, Ordering::Release);
        }
        // Relaxed: see the field; its pair is the wait's Relaxed load in `is_cancelled`.
        self.cancelled.store(true, Ordering::Relaxed);
    }
}

impl Drop for AsyncWait {
    /// The coroutine holds its job until it returns (having claimed what the wait parked) or
    /// raises: once the job goes, nobody claims what the wait parked, whatever ended the
    /// coroutine (a cancellation, or its collection unfinished, which raises no
    /// `CancelledError` there), so it goes to the next waiter.
    fn drop(&mut self) {
        // Release: pairs with the Acquire load in `is_abandoned`, as in `_done`.
        self.abandoned.store(true, Ordering::Release);
    }
}

/// Whether an awaitable's wait was cancelled (the future's done callback came).
pub(crate) fn is_cancelled(flag: &AtomicBool) -> bool {
    // Relaxed: pairs with the Relaxed store in `AsyncWait::_done`; nothing else is read through it.
    flag.load(Ordering::Relaxed)
}

/// Whether the coroutine of a job gave up (its future was cancelled): what the job parked is for
/// whoever waits next.
pub(crate) fn is_abandoned(flag: &AtomicBool) -> bool {
    // Acquire: pairs with the Release store in `AsyncWait::_done`.
    flag.load(Ordering::Acquire)
}

/// The coroutine every awaitable wait is: it starts the job on the extension's executor only
/// when awaited (a coroutine never awaited starts no thread), and raises the job's flag when the
/// executor's future is done (so a cancelled task stops the thread).
const RUN: &std::ffi::CStr = c"
import asyncio
import concurrent.futures
import os
import threading

_lock = threading.Lock()
_pool = None
_pid = None

def _executor():
    # One per process: a forked child's copy of its parent's would count idle threads that the
    # child does not have, and queue its waits behind them forever.
    global _pool, _pid
    with _lock:
        if _pool is None or _pid != os.getpid():
            _pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=1 << 16, thread_name_prefix='cuda_ipc-wait')
            _pid = os.getpid()
        return _pool

def _call(job, undo):
    result = job()
    if undo is not None and job._gave_up():
        # The task was cancelled while the wait returned this: the discarded result is let go now.
        undo(result)
    return result

async def run(job, then=None, undo=None):
    future = asyncio.get_running_loop().run_in_executor(_executor(), _call, job, undo)
    future.add_done_callback(job._done)
    try:
        result = await future
    except asyncio.CancelledError:
        if future.done() and not future.cancelled():
            # The wait finished (what it parked is there) and the task was cancelled before it
            # resumed: nobody claims it here, so it goes to the next waiter.
            job._abandon()
            if undo is not None and future.exception() is None:
                undo(future.result())
        raise
    return result if then is None else then()
";

static RUNNER: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// A coroutine that, awaited in an asyncio event loop, runs `wait` on a thread of the extension's
/// executor (the module docs say why not the loop's default one) and returns what it returns;
/// when the awaiting task is cancelled after the wait returned it (before the coroutine resumed),
/// or while the wait was returning it, the result is handed to `undo` (a Python callable of one
/// argument): for a wait that takes something only its caller may let go, such as a buffer
/// (`WriteFrame.abandon`). `wait` must stop, within a slice, once [`is_cancelled`] says so.
/// Awaited outside a running loop it raises `RuntimeError`.
pub(crate) fn awaitable_undoing<'py>(
    py: Python<'py>,
    wait: impl FnOnce(Python<'_>, &AtomicBool) -> PyResult<Py<PyAny>> + Send + 'static,
    undo: Py<PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    run_job(py, wait, None, Some(undo), Arc::default())
}

/// [`awaitable_undoing`], without `undo`, whose coroutine, once the wait returned, returns `then()` instead: for a wait
/// that leaves what it took where a later wait finds it (`Posted`), so that a cancellation
/// landing after the take loses nothing (only the coroutine still awaited claims it).
pub(crate) fn awaitable_then<'py>(
    py: Python<'py>,
    wait: impl FnOnce(Python<'_>, &AtomicBool) -> PyResult<Py<PyAny>> + Send + 'static,
    then: Py<PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    run_job(py, wait, Some(then), None, Arc::default())
}

/// The `then` of [`awaitable_parking`] for job `job` of `owner`: `functools.partial(owner._claim,
/// job)`, which claims what that job's wait parked.
pub(crate) fn claim_of(owner: &Bound<'_, PyAny>, job: u64) -> PyResult<Py<PyAny>> {
    let py = owner.py();
    Ok(py
        .import("functools")?
        .getattr("partial")?
        .call1((owner.getattr("_claim")?, job))?
        .unbind())
}

/// [`awaitable_then`] whose wait is also handed the job's abandoned flag ([`is_abandoned`]), to
/// park with what it took: `then()` claims it while the coroutine is awaited; once the coroutine
/// gave up, the flag says that the next waiter may take it instead.
pub(crate) fn awaitable_parking<'py>(
    py: Python<'py>,
    wait: impl FnOnce(Python<'_>, &AtomicBool, Arc<AtomicBool>) -> PyResult<Py<PyAny>> + Send + 'static,
    then: Py<PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    let abandoned = Arc::new(AtomicBool::new(false));
    let handed = abandoned.clone();
    run_job(
        py,
        move |py, cancelled| wait(py, cancelled, handed),
        Some(then),
        None,
        abandoned,
    )
}

fn run_job<'py>(
    py: Python<'py>,
    wait: impl FnOnce(Python<'_>, &AtomicBool) -> PyResult<Py<PyAny>> + Send + 'static,
    then: Option<Py<PyAny>>,
    undo: Option<Py<PyAny>>,
    abandoned: Arc<AtomicBool>,
) -> PyResult<Bound<'py, PyAny>> {
    let run = RUNNER.get_or_try_init(py, || -> PyResult<Py<PyAny>> {
        Ok(
            PyModule::from_code(py, RUN, c"cuda_ipc/_aio.py", c"cuda_ipc._aio")?
                .getattr("run")?
                .unbind(),
        )
    })?;
    let job = Bound::new(
        py,
        AsyncWait {
            cancelled: AtomicBool::new(false),
            abandoned,
            wait: Mutex::new(Some(Box::new(wait))),
        },
    )?;
    run.bind(py).call1((job, then, undo))
}
