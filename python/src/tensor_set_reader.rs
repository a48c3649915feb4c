//! The `TensorSetReader` and `TensorHold` classes (`cuda_ipc::tensorset::TensorSetReader`,
//! `Held`).
//!
//! A reader maps every allocation once at open and keeps the mappings; the dict of each buffer's
//! tensors is built once (`tensors::build`) and handed out as a new `dict` of the same tensors for
//! every generation that buffer holds, so a new generation costs no import and no tensor
//! construction. Streams: `TensorHold.tensors()` makes PyTorch's current stream (or `stream=`)
//! wait on the GPU for the generation, and the release (`release()`, the `with` block's end, or
//! collection) is ordered after the work enqueued on that stream by then.

mod parking;

use crate::args::{Int, Seconds, Text, device_arg, host_stream_refused, timeout_arg, wait_arg};
use crate::errors;
use crate::tensors;
use crate::util::{Stop, err, lock, sliced, work_stream};
use cuda_ipc::driver::Device;
use cuda_ipc::identity::ForkEpoch;
use cuda_ipc::tensorset::owned::OwnedHeld;
use cuda_ipc::tensorset::{Location, ReaderOptions};
use parking::{Job, PENDING_POLL, Parking};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

type RustReader = cuda_ipc::tensorset::TensorSetReader;

/// The reading end of a tensor set (`cuda_ipc::tensorset::TensorSetReader`).
///
/// Once `close()` was called, every call but `name` and `close` raises `TensorSetClosed` (the
/// class a writer's close raises, its message naming this reader), also a wait in another thread
/// (within a slice, 50 ms) and an awaited `wait_newer_async`. `TensorHold`s taken before stay
/// readable until released: they keep the mappings (`close`).
///
/// In a child made by `fork()` after the parent opened it, the reader's slot is the parent's:
/// every call but `name` raises `NotSupported` (an awaited `wait_newer_async` too), taking no
/// lock; `close()`, the end of a `with` block and its collection leave nothing.
///
/// Holds a cancelled `wait_newer_async` took are parked on the reader ([`Parking`]): its next
/// take hands them out (`wait_newer`, `wait_newer_async`, `current`), so a cancellation never
/// releases a generation unseen that the writer's `wait_readers()` counted as taken.
#[pyclass(module = "cuda_ipc", frozen)]
pub(crate) struct TensorSetReader {
    inner: Mutex<Option<Arc<RustReader>>>,
    name: String,
    device: i32,
    host: bool,
    /// Each buffer's dict, built at its first hold.
    dicts: Mutex<Vec<Option<Py<PyDict>>>>,
    /// The tensors' names as `str`s, made at the first dict and shared by every buffer's.
    names: PyOnceLock<Py<PyTuple>>,
    /// The tensors over the stable addresses (`stable_addresses=True`), built at the first
    /// `stable_tensors()` and the same objects until `close()`.
    stable: Mutex<Option<Py<PyDict>>>,
    /// Holds that `wait_newer_async` waits took, each until its coroutine claims it (`_claim`)
    /// or, once that coroutine gave up, until the reader's next take hands it out or lets it go.
    /// Cleared by `close()`.
    parked: Mutex<Parking>,
    /// Held by a wait for one slice of its take, the look at `parked` and the park included:
    /// waits of one reader take one at a time, so a cancelled wait's thread, still in its last
    /// slice, cannot park a generation older than one the next wait hands out.
    taking: Mutex<()>,
    /// The next `wait_newer_async` job's number (what `_claim` is given).
    next_job: AtomicU64,
    /// The process (by fork) that opened it: a forked child's calls raise `NotSupported`.
    fork: ForkEpoch,
}

impl TensorSetReader {
    /// The reader, or `TensorSetClosed` once `close()` was called; `NotSupported` in a forked
    /// child, before any lock is taken.
    fn get(&self) -> PyResult<Arc<RustReader>> {
        errors::check_fork(self.fork, "tensor set reader")?;
        lock(&self.inner).clone().ok_or_else(|| self.closed_error())
    }

    /// What every call raises once `close()` was called (`errors::closed_here`).
    fn closed_error(&self) -> PyErr {
        errors::closed_here("reader", &self.name)
    }

    fn is_closed(&self) -> bool {
        lock(&self.inner).is_none()
    }

    fn hold(&self, py: Python<'_>, slf: &Bound<'_, Self>, h: OwnedHeld) -> TensorHold {
        let _ = py;
        TensorHold {
            generation: h.held().generation(),
            buffer: h.held().buffer(),
            content: h.held().content(),
            held: Mutex::new(Some(h)),
            reader: slf.clone().unbind(),
            target: Mutex::new(None),
            fork: self.fork,
        }
    }

    /// Waits (GIL released, in slices) for a generation newer than `than` and holds it: a parked
    /// hold first ([`Parking::take_abandoned`]).
    fn wait(
        &self,
        py: Python<'_>,
        than: u64,
        timeout: Option<Duration>,
    ) -> PyResult<Option<OwnedHeld>> {
        let r = self.get()?;
        sliced(
            py,
            timeout,
            || self.is_closed(),
            |_| self.closed_error(),
            |slice| self.take_slice(&r, than, slice, None),
        )
        .map(Option::flatten)
    }

    /// `wait_newer_async`'s wait, in the executor's thread: as `wait`, stopping (`Closed`) also
    /// once the job's `cancelled` is raised; the hold is parked as the job's, for its
    /// coroutine's `_claim`. `Ok(false)`: the timeout ran out.
    fn park_until(
        &self,
        py: Python<'_>,
        than: u64,
        timeout: Option<Duration>,
        job: &Job<'_>,
    ) -> PyResult<bool> {
        let r = self.get()?;
        let got = sliced(
            py,
            timeout,
            || self.is_closed() || crate::aio::is_cancelled(job.cancelled),
            |_| self.closed_error(),
            |slice| self.take_slice(&r, than, slice, Some(job)),
        )?;
        Ok(got.is_some())
    }

    /// One slice of a take newer than `than`, one take at a time (`taking`): a parked hold whose
    /// coroutine gave up first, else one from the set, waited for up to `slice`. Without `job`
    /// (`wait_newer`, `current`) the hold is handed out; with it, parked for that job's coroutine
    /// before `taking` is let go. An awaited wait (`job`) also waits, within its slice, while an
    /// earlier awaited wait's hold is neither claimed nor given up ([`Parking::pending`]): that
    /// hold goes first (to its coroutine, or to this wait once given up), so that this wait does
    /// not take a newer generation from the set meanwhile, and the reader's awaited waits return
    /// their generations in the order they took them. A blocking wait does not wait for them:
    /// called on the event loop's own thread, it would wait for a coroutine that loop cannot
    /// resume meanwhile.
    fn take_slice(
        &self,
        r: &Arc<RustReader>,
        than: u64,
        slice: Duration,
        job: Option<&Job<'_>>,
    ) -> Result<Option<Option<OwnedHeld>>, Stop> {
        let deadline = Instant::now().checked_add(slice);
        let deliver = |p: &mut Parking, h: OwnedHeld| match job {
            Some(job) => p.park(job, h).map(|()| None),
            None => p.hand_out(h).map(Some),
        };
        loop {
            let one = lock(&self.taking);
            // Looked at again once this take's turn came (another's slice may have taken up to
            // 50 ms): a close or a cancellation meanwhile ends it now.
            if self.is_closed() || job.is_some_and(|j| crate::aio::is_cancelled(j.cancelled)) {
                return Err(Stop::Closed);
            }
            let mut let_go = Vec::new();
            let pending = {
                let mut p = lock(&self.parked);
                if let Some(h) = p.take_abandoned(than, &mut let_go) {
                    let got = deliver(&mut p, h);
                    drop(p);
                    drop(let_go);
                    return got.map(Some);
                }
                job.is_some() && p.pending()
            };
            // Released outside the lock of the parked holds, as a discarded hold is.
            drop(let_go);
            if pending {
                drop(one);
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    return Ok(None);
                }
                std::thread::sleep(PENDING_POLL);
                continue;
            }
            let left = deadline.map_or(slice, |d| d.saturating_duration_since(Instant::now()));
            return match OwnedHeld::wait_newer(r, than, Some(left))? {
                Some(h) => deliver(&mut lock(&self.parked), h).map(Some),
                None => Ok(None),
            };
        }
    }

    /// `current()`'s look without waiting: the newest of the generation published now and the
    /// parked holds whose coroutines gave up; the others are let go. `Ok(None)`: neither.
    fn current_now(&self, r: &Arc<RustReader>) -> Result<Option<OwnedHeld>, Stop> {
        let now = OwnedHeld::current(r);
        let mut p = lock(&self.parked);
        let mut let_go = Vec::new();
        // Every parked hold but the newest given up one goes (none that the newest handed out
        // passed: `take_abandoned(0, ..)` lets those go).
        let mut parked = None;
        while let Some(h) = p.take_abandoned(0, &mut let_go) {
            if let Some(older) = parked.replace(h) {
                let_go.push(older);
            }
        }
        let got = match (now, parked) {
            (Ok(Some(now)), Some(parked)) => {
                let (newest, other) = if parked.held().generation() > now.held().generation() {
                    (parked, now)
                } else {
                    (now, parked)
                };
                let_go.push(other);
                p.hand_out(newest).map(Some)
            }
            (Ok(Some(h)), None) | (Ok(None) | Err(_), Some(h)) => p.hand_out(h).map(Some),
            (Ok(None), None) => Ok(None),
            (Err(e), None) => Err(Stop::Failed(e)),
        };
        drop(p);
        // Released outside the lock of the parked holds, as a discarded hold is.
        drop(let_go);
        got
    }
}

#[pymethods]
impl TensorSetReader {
    /// Opens tensor set `name`: checks its manifest, maps every allocation once (read-only where
    /// the memory allows: `read_only`), and joins its generations. `device`: the CUDA ordinal to
    /// map it on (`None`: the device that holds it, found by UUID). `expect_layout`: the writer's
    /// 32-byte `layout_fingerprint` (`bytes` or any object exporting a buffer, as
    /// `expect_content`); another layout raises `LayoutMismatch`.
    ///
    /// Opened after the writer's death, a VMM set that a `TensorSetHolder` (or a `serve=True`
    /// reader) keeps is read *writerless* (`writerless`): its memory imported from a holder, its
    /// last whole generation served; `NoServer` when no live holder answers.
    ///
    /// `serve=True` (VMM sets): this reader also serves the set's file descriptors to readers
    /// opened after the writer's death, as a `TensorSetHolder` does, until it is closed; raises
    /// `NotHoldable` for other sets, `NoHolderSlot` when every holder slot is taken.
    /// `stable_addresses=True` (VMM sets): one address range per allocation is reserved for the
    /// reader's life (`switch_stable`, `stable_tensors`); raises `NotSupported` for other sets.
    #[new]
    /// `expect_content` (32 bytes): every generation taken must carry that content fingerprint
    /// (`commit(fingerprint=True)` or the writer's own); raises `ContentMismatch` otherwise.
    #[pyo3(signature = (name, *, device=None, expect_layout=None, read_only=true,
        wait=Text::lit("spin_then_block"), spin=Seconds::Float(50e-6), serve=false,
        stable_addresses=false, expect_content=None))]
    #[pyo3(
        text_signature = "(name, *, device=None, expect_layout=None, read_only=True, \
        wait=\"spin_then_block\", spin=..., serve=False, stable_addresses=False, \
        expect_content=None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        name: Text,
        device: Option<Int>,
        expect_layout: Option<&Bound<'_, PyAny>>,
        read_only: bool,
        wait: Text,
        spin: Seconds,
        serve: bool,
        stable_addresses: bool,
        expect_content: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let mut opts = ReaderOptions::new();
        opts.read_only = read_only;
        opts.serve = serve;
        opts.stable_addresses = stable_addresses;
        let name = name.into_string(py, "name")?;
        opts.wait = wait_arg(py, wait.get(py, "wait")?, spin)?;
        opts.expect_layout = crate::args::fingerprint_arg(py, "expect_layout", expect_layout)?;
        opts.expect_content = crate::args::fingerprint_arg(py, "expect_content", expect_content)?;
        let device = device.map(|d| device_arg(py, d)).transpose()?;
        let r = py
            .detach(|| -> cuda_ipc::Result<RustReader> {
                match device {
                    Some(d) => match Device::get(d).and_then(|dev| dev.primary_context()) {
                        Ok(ctx) => RustReader::open(&ctx, &name, &opts),
                        // No such device, or no driver: a host set needs none (as its writer
                        // does not), a GPU set says why it cannot be mapped.
                        Err(cuda) => match RustReader::open_host(&name, &opts) {
                            Err(cuda_ipc::Error::TensorSet(
                                cuda_ipc::tensorset::TensorSetError::WrongKind(_),
                            )) => Err(cuda),
                            other => other,
                        },
                    },
                    None => RustReader::open_auto(&name, &opts),
                }
            })
            .map_err(|e| err(py, e))?;
        // The context, not the stream: the reader's stream is made at its first need.
        let (host, device) = match r.context() {
            Ok(c) => (false, c.device().ordinal() as i32),
            Err(_) => (true, -1),
        };
        let buffers = r.buffers();
        Ok(TensorSetReader {
            inner: Mutex::new(Some(Arc::new(r))),
            name,
            device,
            host,
            dicts: Mutex::new((0..buffers).map(|_| None).collect()),
            names: PyOnceLock::new(),
            stable: Mutex::new(None),
            parked: Mutex::new(Parking::default()),
            taking: Mutex::new(()),
            next_job: AtomicU64::new(0),
            fork: ForkEpoch::now(),
        })
    }

    /// The newest generation, held (`TensorHold`), even one this reader took before. `timeout`:
    /// seconds to wait for a first generation when none is published yet (0: return `None` at
    /// once; `None`: wait without bound). Raises `TensorSetClosed` when this reader is closed,
    /// also by `close()` from another thread while this waits, or its writer closed the set.
    /// A hold a cancelled `wait_newer_async` left (see there) counts: the newest of it and the
    /// generation published now is returned, the other let go (also after the writer closed the
    /// set, when that hold is all there is).
    #[pyo3(signature = (timeout=Seconds::Float(0.0)))]
    fn current(
        slf: Bound<'_, Self>,
        py: Python<'_>,
        timeout: Option<Seconds>,
    ) -> PyResult<Option<TensorHold>> {
        let this = slf.get();
        // Checked first, used or not: a bad value is a mistake even when a generation is there.
        let timeout = timeout_arg(py, timeout)?;
        let r = this.get()?;
        let now = match py.detach(|| this.current_now(&r)) {
            Ok(now) => now,
            Err(Stop::Failed(e)) => return Err(err(py, e)),
            Err(Stop::Closed) => return Err(this.closed_error()),
        };
        if let Some(h) = now {
            return Ok(Some(this.hold(py, &slf, h)));
        }
        if timeout == Some(Duration::ZERO) {
            return Ok(None);
        }
        Ok(this.wait(py, 0, timeout)?.map(|h| this.hold(py, &slf, h)))
    }

    /// Waits up to `timeout` seconds (`None`: without bound) for a generation newer than `than`
    /// and holds it. Raises `Timeout`, `WriterGone` when the writer died (within about 1 s),
    /// `TensorSetClosed` when it closed the set, or when this reader is closed (also by `close()`
    /// from another thread while this waits: within 50 ms). A hold a cancelled
    /// `wait_newer_async` left newer than `than` is returned first, at once (see there).
    #[pyo3(signature = (than, timeout=None))]
    fn wait_newer(
        slf: Bound<'_, Self>,
        py: Python<'_>,
        than: Int,
        timeout: Option<Seconds>,
    ) -> PyResult<TensorHold> {
        let this = slf.get();
        let than: u64 = than.get(py, "than")?;
        let timeout = timeout_arg(py, timeout)?;
        match this.wait(py, than, timeout)? {
            Some(h) => Ok(this.hold(py, &slf, h)),
            None => Err(crate::util::timeout_error(
                py,
                "a newer tensor-set generation",
                timeout,
            )),
        }
    }

    /// `wait_newer` as a coroutine: awaited, it waits on a thread of the extension's own
    /// executor (without the GIL; a thread for every wait pending), so the loop goes on meanwhile; cancelling the
    /// awaiting task stops that thread within 50 ms (`crate::aio`). Raises what `wait_newer`
    /// raises when awaited (`TensorSetClosed` for a closed reader), not when called.
    ///
    /// A generation the wait took in the instant its task was cancelled (or that the task, once
    /// cancelled, never resumed to return) is not released: it is kept on this reader, still
    /// held, for its next take. The next `wait_newer(than)` or `wait_newer_async(than)` returns
    /// it at once when it is newer than `than`, oldest first, and lets it go when it is not (the
    /// caller asks past it); `current()` returns the newer of it and the generation published
    /// now, letting the other go. So no cancellation loses a generation that the writer's
    /// `wait_readers()` counted as taken: `publish(final); wait_readers(); close()` still
    /// delivers `final` to a reader that retries after a cancelled wait. A kept generation older
    /// than one this reader already returned is let go, never returned: callers never see
    /// generation g + 1 and then g. The reader's awaited waits return generations in the order
    /// they took them: while one's generation waits for its coroutine to resume, the others wait
    /// for it (that coroutine returns it, or, once cancelled, the next wait does); a blocking
    /// `wait_newer` in another thread does not wait for them. `close()` releases what is kept.
    #[pyo3(signature = (than, timeout=None))]
    fn wait_newer_async<'py>(
        slf: Bound<'py, Self>,
        than: Int,
        timeout: Option<Seconds>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let than: u64 = than.get(py, "than")?;
        let timeout = timeout_arg(py, timeout)?;
        // Relaxed: a number only, it orders no memory (the parked hold is handed over under
        // `parked`'s lock).
        let id = slf.get().next_job.fetch_add(1, Ordering::Relaxed);
        let claim = crate::aio::claim_of(slf.as_any(), id)?;
        let this = slf.unbind();
        crate::aio::awaitable_parking(
            py,
            move |py, cancelled, abandoned| {
                let job = Job {
                    id,
                    cancelled,
                    abandoned: &abandoned,
                };
                if this.get().park_until(py, than, timeout, &job)? {
                    Ok(py.None())
                } else {
                    Err(crate::util::timeout_error(
                        py,
                        "a newer tensor-set generation",
                        timeout,
                    ))
                }
            },
            claim,
        )
    }

    /// Takes the hold `wait_newer_async` job `job` parked (what its coroutine returns once its
    /// thread is done); `TensorSetClosed` when `close()` came meanwhile (it releases parked
    /// holds); `NotSupported` in a forked child (the parked holds are the parent's waits').
    fn _claim(slf: Bound<'_, Self>, py: Python<'_>, job: u64) -> PyResult<TensorHold> {
        let this = slf.get();
        // Before `parked` is locked: a parent's wait may have held it at the fork.
        errors::check_fork(this.fork, "tensor set reader")?;
        let h = lock(&this.parked).claim(job);
        match h {
            Some(h) => Ok(this.hold(py, &slf, h)),
            None => Err(this.closed_error()),
        }
    }

    /// The set's name.
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// Driver imports the open made (one per allocation and buffer not already mapped in this
    /// process).
    #[getter]
    fn imports(&self) -> PyResult<u32> {
        Ok(self.get()?.imports())
    }

    /// Whether the mappings are read-only (VMM memory with `read_only=True`).
    #[getter]
    fn read_only(&self) -> PyResult<bool> {
        Ok(self.get()?.is_read_only())
    }

    /// The set's layout fingerprint (32 bytes).
    #[getter]
    fn layout_fingerprint<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        Ok(PyBytes::new(py, &self.get()?.layout().fingerprint()))
    }

    /// The tensors' names, in the set's order.
    #[getter]
    fn names<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        tensors::names(py, self.get()?.layout())
    }

    /// Which creation of the set under this name this reader maps (an int, 64 random bits,
    /// nonzero, drawn when the writer created it). A writer that replaced a dead or closed one
    /// has another and numbers its generations from 1 again: compare this, not `generation`, to
    /// tell its generations from the old writer's.
    #[getter]
    fn incarnation(&self) -> PyResult<u64> {
        Ok(self.get()?.incarnation())
    }

    /// Whether this reader was opened after its writer's death: it reads the last whole
    /// generation (memory forwarded by a holder); no newer one comes (`wait_newer` raises
    /// `WriterGone` at once when asked for a newer one).
    #[getter]
    fn writerless(&self) -> PyResult<bool> {
        Ok(self.get()?.is_writerless())
    }

    /// Whether this reader's writer is alive, asked now: `False` once it closed the set or died
    /// (a writer made again under the name is another: open the set again to read it), and for
    /// a writerless reader. `current()` goes on returning the last generation published after
    /// the writer is gone; a reader that only polls `current()` learns here that no newer one
    /// comes (`wait_newer` raises `WriterGone` or `TensorSetClosed`).
    #[getter]
    fn writer_alive(&self) -> PyResult<bool> {
        Ok(self.get()?.writer_alive())
    }

    /// Where the open spent its time, in microseconds (floats): `manifest` (open, copy, decode
    /// and check the manifest on the opening thread), `tables` (decode its tensor tables: on the
    /// join thread, beside the mapping, for a GPU set; for a host set on the opening thread,
    /// part of `manifest`), `fingerprint`
    /// (recompute the layout fingerprint), `fd_fetch`
    /// (fetch the file descriptors from the writer or a holder), `map` (the rest of the mapping:
    /// the driver imports, or a host set's data segment), `join` (join the generation channel),
    /// `join_gpu` (the start of its watchdog thread: its stream is made at first need),
    /// `join_wait` (how long the mapping waited for the join), `fd_peer`, `fd_connect` and
    /// `fd_reply` (parts of `fd_fetch`: the exporter's liveness, the connection with its checks,
    /// the request and reply), `spawn` (starting the join thread), `finish` (after the mapping,
    /// to the reader returned) and `total` (the whole open). On a GPU set the mapping and the join overlap: `total` is
    /// about `manifest` plus the longer of the two.
    fn open_timings<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let t = self.get()?.open_timings();
        let d = PyDict::new(py);
        let us = |x: std::time::Duration| x.as_secs_f64() * 1e6;
        d.set_item("manifest", us(t.manifest))?;
        d.set_item("tables", us(t.tables))?;
        d.set_item("fingerprint", us(t.fingerprint))?;
        d.set_item("fd_fetch", us(t.fd_fetch))?;
        d.set_item("map", us(t.map))?;
        d.set_item("join", us(t.join))?;
        d.set_item("join_gpu", us(t.join_gpu))?;
        d.set_item("join_wait", us(t.join_wait))?;
        d.set_item("fd_peer", us(t.fd_peer))?;
        d.set_item("fd_connect", us(t.fd_connect))?;
        d.set_item("fd_reply", us(t.fd_reply))?;
        d.set_item("spawn", us(t.spawn))?;
        d.set_item("finish", us(t.finish))?;
        d.set_item("total", us(t.total))?;
        Ok(d)
    }

    /// Maps `hold`'s generation at this reader's stable addresses (`stable_addresses=True`),
    /// where `stable_tensors()` see it, so that CUDA graphs captured over those tensors read it
    /// (`cuda_ipc::tensorset::TensorSetReader::switch_stable`). Consumes `hold`: afterwards it
    /// is no longer held (`hold.held` is `False`, its `tensors()` raise) and the reader keeps
    /// the generation held instead, until the next switch or `release_stable()`.
    ///
    /// When the generation lies in another buffer than the one mapped there, waits for all work
    /// of the reader's CUDA context first (`cuCtxSynchronize`, GIL released): call it between
    /// steps, never under the graphs' kernels, and not while work of the context waits for
    /// another process. Returns `{"generation": int, "remapped": bool, "micros": int,
    /// "remap_micros": int}` (the whole call and the remapping alone, in microseconds).
    ///
    /// Raises `TensorSetClosed` when this reader is closed, and `InvalidArgument` when `hold` is
    /// another reader's: both leave `hold` as it was. Then `InvalidArgument` when the reader was
    /// opened without `stable_addresses`, `hold` was released already, or the reader is
    /// writerless (its one generation stays at the addresses it has); `CudaError` naming the
    /// failed call (then nothing is left at the stable addresses, `stable_generation` is `None`;
    /// a later switch maps again). The hold is released on each of these.
    fn switch_stable<'py>(
        &self,
        py: Python<'py>,
        hold: &Bound<'py, TensorHold>,
    ) -> PyResult<Bound<'py, PyDict>> {
        self.get()?;
        let hold = hold.get();
        // The hold's own reader is the one switched (`OwnedHeld::switch_stable`): another
        // reader's hold would switch that reader, closed or not.
        if !std::ptr::eq(hold.reader.get(), self) {
            return Err(errors::invalid_argument(
                py,
                "switch_stable takes a generation this reader holds, not another reader's"
                    .to_string(),
            ));
        }
        // The stable generation's hold lasts past the work of the stream `tensors()` made ready
        // (a remap waits for the whole context; in place the hold is kept): that order is not
        // needed any more.
        lock(&hold.target).take();
        let owned = lock(&hold.held).take().ok_or_else(|| {
            errors::invalid_argument(py, "this generation was released".to_string())
        })?;
        let s = py
            .detach(|| owned.switch_stable())
            .map_err(|e| err(py, e))?;
        let d = PyDict::new(py);
        d.set_item("generation", s.generation)?;
        d.set_item("remapped", s.remapped)?;
        d.set_item("micros", s.micros)?;
        d.set_item("remap_micros", s.remap_micros)?;
        Ok(d)
    }

    /// The tensors at the stable addresses: a new `dict[str, torch.Tensor]` in the set's order,
    /// of the same tensor objects for the reader's life (built at the first call), so that CUDA
    /// graphs captured over them stay valid across `switch_stable` calls. They read the
    /// generation switched there (`stable_generation`): nothing before the first switch or after
    /// `release_stable()` (a buffered set's reads then fault the context; capture graphs over
    /// them, run them after a switch). In-place sets: the buffer's own addresses. No stream is
    /// ordered: the generation there is ready for any stream when `switch_stable` returns.
    /// Raises `InvalidArgument` without `stable_addresses=True`, `TensorSetClosed` once this
    /// reader is closed (the tensors handed out before stay valid: they keep the mappings).
    fn stable_tensors<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let r = self.get()?;
        if let Some(d) = lock(&self.stable).as_ref() {
            return d.bind(py).copy();
        }
        let bases =
            tensors::allocation_bases(r.layout(), |i| r.stable_ptr(i)).map_err(|e| err(py, e))?;
        let names = self
            .names
            .get_or_try_init(py, || tensors::name_strings(py, r.layout()))?
            .bind(py);
        let owner: Arc<dyn std::any::Any + Send + Sync> = r.clone();
        let d = tensors::build(py, r.layout(), &bases, self.device, names, Some(owner))?;
        // Two threads may both build: the first stored wins, so every caller gets its tensors.
        let mut slot = lock(&self.stable);
        // Looked at under the slot's lock, which `close()` takes after it closed: tensors stored
        // after its `take` would keep the closed reader's mappings as long as this object.
        if self.is_closed() {
            return Err(self.closed_error());
        }
        let kept = slot.get_or_insert_with(|| d.unbind());
        kept.bind(py).copy()
    }

    /// The generation at the stable addresses; `None` before the first `switch_stable`, after
    /// `release_stable()` or a failed switch, and without `stable_addresses=True`.
    #[getter]
    fn stable_generation(&self) -> PyResult<Option<u64>> {
        Ok(self.get()?.stable_generation())
    }

    /// Lets the stable generation go: waits for all work of the reader's context
    /// (`cuCtxSynchronize`, GIL released), unmaps the stable ranges (buffered sets; in place the
    /// addresses stay mapped, but the writer may rewrite them now) and releases the hold; the
    /// addresses stay reserved for the next switch. Returns `False` when nothing was held.
    /// Raises `InvalidArgument` without `stable_addresses=True`; `CudaError` (the hold is kept);
    /// `TensorSetClosed` once this reader is closed (the stable generation is let go with the
    /// reader's last hold and tensor).
    fn release_stable(&self, py: Python<'_>) -> PyResult<bool> {
        let r = self.get()?;
        py.detach(|| r.release_stable()).map_err(|e| err(py, e))
    }

    /// Leaves the set: this reader's slot (and its stable addresses and serving slot) is freed
    /// once no `TensorHold` and no tensor of it is left (they keep it alive). Afterwards every
    /// call but `name` and `close` raises `TensorSetClosed`; a wait in another thread raises it
    /// within 50 ms. Holds taken before stay readable until released; those kept for the next
    /// call (a cancelled `wait_newer_async`'s, see there) are released now. Closing twice does
    /// nothing, and so does a close in a forked child: the slot (and what it keeps) is the
    /// parent's reader's.
    fn close(&self, py: Python<'_>) {
        if self.fork.inherited() {
            return; // a forked child's copy: the parent's reader stays open
        }
        // `inner` first: `stable_tensors()` and `TensorHold.tensors()` store their dicts only
        // while it is there, looked at under the lock of the slot cleared here after it.
        lock(&self.inner).take();
        // Parked holds are released (a coroutine still to claim one raises `TensorSetClosed`),
        // and a take that finishes after this parks and hands out nothing (`Parking::closed`).
        let parked = lock(&self.parked).close();
        py.detach(|| drop(parked));
        lock(&self.dicts).iter_mut().for_each(|d| *d = None);
        lock(&self.stable).take();
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) {
        self.close(py);
    }

    fn __repr__(&self) -> String {
        format!("TensorSetReader({:?})", self.name)
    }
}

/// A held generation (`cuda_ipc::tensorset::Held`): its buffer is not rewritten until it is
/// released (`release()`, the end of a `with` block, or collection) and the GPU work enqueued
/// before that on the stream its tensors were made ready on has run. It keeps its reader's
/// mappings: after the reader's `close()` it stays readable (`tensors()`, `read`, the content
/// checks) until released.
///
/// In a child made by `fork()` after the parent took it, the hold is the parent's: `whole`,
/// `held`, `tensors()` (also the tensors a parent's call built), `read` and the content checks
/// raise `NotSupported`, taking no lock; `release()`, the end of a `with` block and its collection
/// release nothing; `generation`, `buffer` and `content` describe the copy.
#[pyclass(module = "cuda_ipc", frozen)]
pub(crate) struct TensorHold {
    /// The generation, its buffer and content fingerprint: readable after the release too.
    generation: u64,
    buffer: usize,
    content: [u8; 32],
    held: Mutex<Option<OwnedHeld>>,
    reader: Py<TensorSetReader>,
    /// The raw stream `tensors()` made ready (the release is ordered after it).
    target: Mutex<Option<usize>>,
    /// The process (by fork) that took the hold (its reader's): a forked child's calls raise
    /// `NotSupported` before taking `held`, which a parent's content check holds without the GIL.
    fork: ForkEpoch,
}

impl TensorHold {
    /// `NotSupported` in a process forked from the one that took the hold.
    fn check_fork(&self) -> PyResult<()> {
        errors::check_fork(self.fork, "tensor set hold")
    }

    fn with<T>(&self, py: Python<'_>, f: impl FnOnce(&OwnedHeld) -> PyResult<T>) -> PyResult<T> {
        self.check_fork()?;
        match lock(&self.held).as_ref() {
            Some(h) => f(h),
            None => Err(errors::invalid_argument(
                py,
                "this generation was released".to_string(),
            )),
        }
    }

    /// `f` on the held generation, without the GIL (the caller detaches); `InvalidArgument`
    /// once released.
    fn held_call<T>(
        &self,
        f: impl FnOnce(&cuda_ipc::tensorset::Held<'_>) -> cuda_ipc::Result<T>,
    ) -> cuda_ipc::Result<T> {
        self.fork.check("tensor set hold")?;
        match lock(&self.held).as_ref() {
            Some(h) => f(h.held()),
            None => Err(cuda_ipc::Error::InvalidArgument(
                "this generation was released".to_string(),
            )),
        }
    }

    /// Releases the hold (after `target`'s work); nothing in a forked child, whose copy is the
    /// parent's hold (neither lock is taken there: a thread of the parent may have held one).
    fn release_now(&self) -> cuda_ipc::Result<()> {
        if self.fork.inherited() {
            return Ok(());
        }
        let Some(h) = lock(&self.held).take() else {
            return Ok(());
        };
        if let Some(s) = lock(&self.target).take() {
            // SAFETY: `s` is the stream `tensors()` resolved (the caller's or PyTorch's current
            // stream, which PyTorch never destroys, or a default-stream sentinel).
            if let Err(e) = unsafe { h.held().release_after_raw(s as _) } {
                // Without the ordering the writer could overwrite the buffer under work still
                // queued there: wait for the reader's context instead.
                // The context, not the stream: making the reader's stream may be what failed.
                let sync = h.held().context().and_then(|c| c.synchronize());
                drop(h);
                return sync.and(Err(e));
            }
        }
        drop(h);
        Ok(())
    }
}

#[pymethods]
impl TensorHold {
    /// The generation number (also after the release).
    #[getter]
    fn generation(&self) -> u64 {
        self.generation
    }

    /// The buffer that holds it.
    #[getter]
    fn buffer(&self) -> usize {
        self.buffer
    }

    /// The content fingerprint the writer committed (32 bytes; all zeros: none).
    #[getter]
    fn content<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.content)
    }

    /// Whether the generation is known whole, asked now (`Held::whole`): `True` once the
    /// writer's stream finished it; `None` while that stream still works on it (the GPU work on
    /// its tensors waits for it); `False` when the writer died before its stream was known to
    /// have finished it: the bytes may be partial, and work made ready on it ran over them. A
    /// take never hands out a generation that is `False` already (`WriterGone`). Raises
    /// `InvalidArgument` once released.
    #[getter]
    fn whole(&self, py: Python<'_>) -> PyResult<Option<bool>> {
        self.with(py, |h| Ok(h.held().whole()))
    }

    /// The generation's tensors: a new `dict[str, torch.Tensor]` in the set's order, every value a
    /// view of the mapped memory (no copy; the same tensors for every generation this buffer
    /// holds, built at its first hold). `stream` (default: PyTorch's current stream) is made to
    /// wait for the generation on the GPU, and the release is ordered after its work. PyTorch
    /// tensors carry no read-only flag: an in-place operation on one over a read-only mapping
    /// faults this process's CUDA context. A host set gives CPU tensors over its shared memory
    /// (`stream` must be `None`: `InvalidArgument`), which are not read-only: an in-place operation on one changes the
    /// bytes every reader of that buffer sees, so treat them as read-only. `NotSupported` in a
    /// forked child, before PyTorch is asked for a stream.
    #[pyo3(signature = (*, stream=None))]
    fn tensors<'py>(
        &self,
        py: Python<'py>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        self.check_fork()?;
        let reader = self.reader.get();
        let target = if reader.host {
            host_stream_refused(py, stream)?;
            None
        } else {
            Some(work_stream(py, stream, reader.device)?)
        };
        let (buffer, cached) = self.with(py, |h| {
            let b = h.held().buffer();
            Ok((
                b,
                lock(&reader.dicts)
                    .get(b)
                    .and_then(|d| d.as_ref().map(|d| d.clone_ref(py))),
            ))
        })?;
        let dict = match cached {
            Some(d) => d.into_bound(py),
            None => {
                // The reader (an `Arc`) lives as long as the bases it is handed to; its layout is
                // borrowed from it, not copied (a set of thousands of tensors).
                let r = self.with(py, |h| Ok(h.reader().clone()))?;
                let bases = self.with(py, |h| {
                    let held = h.held();
                    tensors::allocation_bases(r.layout(), |i| {
                        if reader.host {
                            held.host_ptr(i).map(|p| p as u64)
                        } else {
                            held.device_ptr(i)
                        }
                    })
                    .map_err(|e| err(py, e))
                })?;
                let names = reader
                    .names
                    .get_or_try_init(py, || tensors::name_strings(py, r.layout()))?
                    .bind(py);
                let owner: Arc<dyn std::any::Any + Send + Sync> = r.clone();
                let d = tensors::build(py, r.layout(), &bases, reader.device, names, Some(owner))?;
                // Kept for the buffer's next holds while the reader is open: looked at under the
                // lock of the dicts, which `close()` clears after it closed the reader, so that
                // no dict (whose tensors keep the mappings) outlives the close in the reader.
                let mut dicts = lock(&reader.dicts);
                if !reader.is_closed()
                    && let Some(slot) = dicts.get_mut(buffer)
                {
                    *slot = Some(d.clone().unbind());
                }
                d
            }
        };
        if let Some(target) = target {
            self.with(py, |h| {
                // SAFETY: `target` is the caller's stream or PyTorch's current stream (live for
                // the call), or a default-stream sentinel.
                unsafe { h.held().ready_on_raw(target as _) }.map_err(|e| err(py, e))
            })?;
            *lock(&self.target) = Some(target);
        }
        dict.copy()
    }

    /// A copy of tensor `name`'s bytes (host sets).
    fn read<'py>(&self, py: Python<'py>, name: Text) -> PyResult<Bound<'py, PyBytes>> {
        let name = name.get(py, "name")?;
        self.with(py, |h| {
            let i = h.reader().layout().index_of(name).ok_or_else(|| {
                err(
                    py,
                    cuda_ipc::tensorset::TensorSetError::NoSuchTensor(format!("{name:?}")).into(),
                )
            })?;
            match h.held().tensor(i).map_err(|e| err(py, e))?.location {
                Location::Host(_) => {
                    let v = h.held().read_tensor(i).map_err(|e| err(py, e))?;
                    Ok(PyBytes::new(py, &v))
                }
                _ => Err(errors::not_supported(
                    "a GPU tensor set's bytes are read through tensors()",
                )),
            }
        })
    }

    /// The content digest of each tensor (16 bytes each, in the set's order), computed where the
    /// bytes lie: on a GPU set one kernel on the reader's stream, waited for; on a host set on
    /// the host. Tensors whose digests differ between two generations changed.
    fn tensor_digests<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let d = py
            .detach(|| self.held_call(|h| h.tensor_digests()))
            .map_err(|e| err(py, e))?;
        Ok(d.iter().map(|x| PyBytes::new(py, x)).collect())
    }

    /// The content fingerprint of this generation's bytes (32 bytes), computed here as
    /// `tensor_digests()` is.
    fn fingerprint<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let f = py
            .detach(|| self.held_call(|h| h.fingerprint()))
            .map_err(|e| err(py, e))?;
        Ok(PyBytes::new(py, &f))
    }

    /// Checks the bytes against the fingerprint the writer committed
    /// (`commit(fingerprint=True)`): raises `ContentMismatch` when they differ (also when
    /// the writer committed none).
    fn verify_content(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.held_call(|h| h.verify_content()))
            .map_err(|e| err(py, e))
    }

    /// Whether the generation is still held. `NotSupported` in a forked child (the hold is the
    /// parent's).
    #[getter]
    fn held(&self) -> PyResult<bool> {
        self.check_fork()?;
        Ok(lock(&self.held).is_some())
    }

    /// Releases the generation (after the work enqueued on the stream `tensors()` made ready).
    /// Releasing twice does nothing, and so does a release in a forked child: the hold is the
    /// parent's.
    fn release(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.release_now()).map_err(|e| err(py, e))
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<()> {
        self.release(py)
    }

    fn __repr__(&self) -> String {
        if self.fork.inherited() {
            // Without the lock, which a parent's thread may have held at the fork.
            return format!(
                "TensorHold(generation {}, buffer {}, forked)",
                self.generation, self.buffer
            );
        }
        match lock(&self.held).as_ref() {
            Some(h) => format!(
                "TensorHold(generation {}, buffer {})",
                h.held().generation(),
                h.held().buffer()
            ),
            None => "TensorHold(released)".to_string(),
        }
    }
}

impl Drop for TensorHold {
    fn drop(&mut self) {
        // A forked child's copy of its parent's hold lets go of nothing (`release_now`), and
        // says nothing.
        if let Err(e) = self.release_now()
            && !matches!(e, cuda_ipc::Error::ForkedChild { .. })
        {
            eprintln!("cuda_ipc: releasing a tensor-set generation: {e}");
        }
    }
}
