//! The `Consumer` class.

use crate::args::{Seconds, Text, stream_arg, timeout_arg, wait_arg};
use crate::errors::detached;
use crate::frame::Frame;
use crate::posted::{self, ConsumerSlot, Posted};
use crate::util::{Stop, err, lock, sliced, stats_dict, timeout_error};
use crate::{aio, errors};
use cuda_ipc::channel::owned::OwnedFrame;
use cuda_ipc::channel::{ConsumerOptions, Delivery};
use cuda_ipc::identity::ForkEpoch;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// The consuming end of a channel (`cuda_ipc::channel::Consumer`).
///
/// In a child made by `fork()` after the parent attached, the slot is the parent's: every call but
/// `name` raises `NotSupported` (an awaited `recv_async` too), taking no lock; `close()`, the end
/// of a `with` block and its collection detach nothing.
#[pyclass(module = "cuda_ipc", frozen)]
pub(crate) struct Consumer {
    /// Shared with the receives posted on this consumer, which stop waiting once it is closed.
    inner: ConsumerSlot,
    name: String,
    /// The `stream=` option: every frame is made ready on it and released after it.
    stream: Option<usize>,
    /// Frames that `recv_async` waits took, in the order taken, each until its coroutine claims
    /// it (`_claim`) or, once that coroutine gave up (cancelled), until the next receive takes it:
    /// a cancelled receive loses no frame. Cleared by `close()`.
    parked: Mutex<VecDeque<Parked>>,
    /// Held by a receive for one slice of its wait, the look at `parked` and the park included:
    /// receives of one consumer take frames one at a time, so a cancelled receive's thread, still
    /// in its last slice, cannot park a frame older than one the next receive hands out.
    receiving: Mutex<()>,
    /// The next `recv_async` job's number (what `_claim` is given).
    next_job: AtomicU64,
    /// The process (by fork) that attached: a forked child's calls raise `NotSupported` before
    /// taking `receiving`, which a thread of the parent may have held at the fork.
    fork: ForkEpoch,
}

/// A frame a `recv_async` wait took for its coroutine.
struct Parked {
    job: u64,
    /// Raised when that coroutine gave up ([`aio::is_abandoned`]).
    abandoned: Arc<AtomicBool>,
    frame: OwnedFrame,
}

impl Consumer {
    /// The Rust consumer, shared with the caller (it lives until the last user lets go), or
    /// `Detached` once closed; `NotSupported` in a forked child, before any lock is taken.
    pub(crate) fn get(&self, py: Python<'_>) -> PyResult<Arc<cuda_ipc::channel::Consumer>> {
        errors::check_fork(self.fork, "channel consumer")?;
        lock(&self.inner).clone().ok_or_else(|| detached(py))
    }

    pub(crate) fn is_closed(&self) -> bool {
        lock(&self.inner).is_none()
    }

    /// `f`, taken by a receive, unless `close()` came meanwhile: then `f` is released (this closed
    /// consumer's frame, which nobody else was to get) and the receive raises `Detached`. Decided
    /// under the lock `close()` takes the consumer under, so each receive is ordered against the
    /// close: a frame is returned only by a receive that took it before the close.
    pub(crate) fn hand_out(&self, f: OwnedFrame) -> Result<OwnedFrame, Stop> {
        let open = lock(&self.inner).is_some();
        if open {
            Ok(f)
        } else {
            drop(f);
            Err(Stop::Closed)
        }
    }
}

impl Consumer {
    /// The first parked frame whose coroutine gave up, taken out (the caller holds `receiving`).
    fn take_abandoned(&self) -> Option<OwnedFrame> {
        let mut parked = lock(&self.parked);
        let i = parked
            .iter()
            .position(|p| aio::is_abandoned(&p.abandoned))?;
        parked.remove(i).map(|p| p.frame)
    }

    /// One receive of at most `slice`, one receive at a time: a frame a cancelled `recv_async`
    /// left first, else the next from the channel, handed to `deliver` before `receiving` is let
    /// go (a `recv_async` job parks it there for its coroutine, so no later receive hands out a
    /// newer frame first). `cancelled`: an awaitable's flag, looked at once this receive's turn
    /// came.
    fn receive_slice<T>(
        &self,
        c: &Arc<cuda_ipc::channel::Consumer>,
        slice: std::time::Duration,
        cancelled: Option<&AtomicBool>,
        deliver: impl FnOnce(OwnedFrame) -> T,
    ) -> Result<Option<T>, Stop> {
        let _one = lock(&self.receiving);
        // Looked at again once this receive's turn came (another's slice may have taken up to
        // 50 ms): a close or a cancellation meanwhile ends it now, not after a slice of its own.
        if self.is_closed() || cancelled.is_some_and(aio::is_cancelled) {
            return Err(Stop::Closed);
        }
        let f = match self.take_abandoned() {
            Some(f) => f,
            None => match OwnedFrame::recv(c, Some(slice))? {
                Some(f) => f,
                None => return Ok(None),
            },
        };
        Ok(Some(deliver(self.hand_out(f)?)))
    }

    /// `recv`.
    fn recv_until(&self, py: Python<'_>, timeout: Option<std::time::Duration>) -> PyResult<Frame> {
        let c = self.get(py)?;
        let got = sliced(
            py,
            timeout,
            || self.is_closed(),
            detached,
            |slice| self.receive_slice(&c, slice, None, |f| f),
        )?;
        match got {
            Some(f) => Frame::new(py, f, self.stream),
            None => Err(timeout_error(py, "a frame", timeout)),
        }
    }

    /// `recv_async`'s wait, in the executor's thread: as `recv`, stopping (`Detached`) also once
    /// `cancelled` is raised; the frame is parked as job `job`'s, for its coroutine's `_claim`.
    fn park_until(
        &self,
        py: Python<'_>,
        timeout: Option<std::time::Duration>,
        cancelled: &AtomicBool,
        job: u64,
        abandoned: &Arc<AtomicBool>,
    ) -> PyResult<()> {
        let c = self.get(py)?;
        let got = sliced(
            py,
            timeout,
            || self.is_closed() || aio::is_cancelled(cancelled),
            detached,
            |slice| {
                self.receive_slice(&c, slice, Some(cancelled), |frame| {
                    lock(&self.parked).push_back(Parked {
                        job,
                        abandoned: abandoned.clone(),
                        frame,
                    })
                })
            },
        )?;
        match got {
            Some(_) => Ok(()),
            None => Err(timeout_error(py, "a frame", timeout)),
        }
    }
}

#[pymethods]
impl Consumer {
    /// Attaches to channel `name` on the device that holds its pool; receives frames published
    /// from now on.
    #[new]
    #[pyo3(signature = (name, *, delivery=Text::lit("every"), wait=Text::lit("spin_then_block"),
        spin=Seconds::Float(50e-6), group_access=false, stream=None))]
    #[pyo3(
        text_signature = "(name, *, delivery=\"every\", wait=\"spin_then_block\", \
        spin=5e-05, group_access=False, stream=None)"
    )]
    fn new(
        py: Python<'_>,
        name: Text,
        delivery: Text,
        wait: Text,
        spin: Seconds,
        group_access: bool,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let name = name.into_string(py, "name")?;
        let wait = wait.get(py, "wait")?;
        let stream = stream_arg(py, stream)?;
        let delivery = match delivery.get(py, "delivery")? {
            "every" => Delivery::EveryFrame,
            "latest" => Delivery::LatestOnly,
            d => {
                return Err(errors::invalid_argument(
                    py,
                    format!("delivery must be \"every\" or \"latest\", got {d:?}"),
                ));
            }
        };
        let opts = ConsumerOptions::new()
            .delivery(delivery)
            .wait(wait_arg(py, wait, spin)?)
            .group_access(group_access);
        let c = py
            .detach(|| cuda_ipc::channel::Consumer::attach(&name, &opts))
            .map_err(|e| err(py, e))?;
        if stream.is_some() && c.is_host() {
            return Err(errors::invalid_argument(
                py,
                "a host-memory channel has no streams to order: leave stream=None".to_string(),
            ));
        }
        Ok(Consumer {
            inner: Arc::new(Mutex::new(Some(Arc::new(c)))),
            name,
            stream,
            parked: Mutex::new(VecDeque::new()),
            receiving: Mutex::new(()),
            next_job: AtomicU64::new(0),
            fork: ForkEpoch::now(),
        })
    }

    /// The same as `Consumer(name, ...)`.
    #[classmethod]
    #[pyo3(signature = (name, *, delivery=Text::lit("every"), wait=Text::lit("spin_then_block"),
        spin=Seconds::Float(50e-6), group_access=false, stream=None))]
    #[pyo3(
        text_signature = "(name, *, delivery=\"every\", wait=\"spin_then_block\", \
        spin=5e-05, group_access=False, stream=None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn attach(
        _cls: &Bound<'_, pyo3::types::PyType>,
        py: Python<'_>,
        name: Text,
        delivery: Text,
        wait: Text,
        spin: Seconds,
        group_access: bool,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        Self::new(py, name, delivery, wait, spin, group_access, stream)
    }

    /// The channel name.
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// Waits up to `timeout` seconds (`None`: forever) for the next frame. `Detached` once
    /// `close()` was called, also from another thread while this waits (it wakes within 50 ms,
    /// and a frame published after the close is never returned).
    #[pyo3(signature = (timeout=None))]
    fn recv(&self, py: Python<'_>, timeout: Option<Seconds>) -> PyResult<Frame> {
        let timeout = timeout_arg(py, timeout)?;
        self.recv_until(py, timeout)
    }

    /// `recv` as an awaitable (`await consumer.recv_async(timeout=1.0)`): it waits on a thread of
    /// the extension's own executor (without the GIL; a thread for every wait pending), so the loop runs other tasks
    /// meanwhile. Cancelling the awaiting task (`asyncio.wait_for`, `task.cancel()`) stops that
    /// thread within 50 ms; a frame it took in that instant is kept, in order, for this
    /// consumer's next receive (`recv`, `try_recv`, iteration or `recv_async`), not lost. Raises
    /// as `recv`.
    #[pyo3(signature = (timeout=None))]
    fn recv_async<'py>(
        slf: Bound<'py, Self>,
        timeout: Option<Seconds>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let timeout = timeout_arg(py, timeout)?;
        let job = slf.get().next_job.fetch_add(1, Ordering::Relaxed);
        let claim = aio::claim_of(slf.as_any(), job)?;
        let this = slf.unbind();
        aio::awaitable_parking(
            py,
            move |py, cancelled, abandoned| {
                this.get()
                    .park_until(py, timeout, cancelled, job, &abandoned)?;
                Ok(py.None())
            },
            claim,
        )
    }

    /// Takes the frame `recv_async` job `job` parked (what its coroutine returns once its thread
    /// is done); `Detached` when `close()` came meanwhile (it releases parked frames);
    /// `NotSupported` in a forked child (the parked frames are the parent's receives').
    fn _claim(&self, py: Python<'_>, job: u64) -> PyResult<Frame> {
        // Before `parked` is locked: a parent's receive may have held it at the fork.
        errors::check_fork(self.fork, "channel consumer")?;
        let f = {
            let mut parked = lock(&self.parked);
            let i = parked.iter().position(|p| p.job == job);
            i.and_then(|i| parked.remove(i)).map(|p| p.frame)
        };
        match f {
            Some(f) => Frame::new(py, f, self.stream),
            None => Err(detached(py)),
        }
    }

    /// Posts the receive of the next frame ahead of its publication
    /// (`cuda_ipc::channel::Consumer::post`): this consumer's stream waits on the GPU for the
    /// frame (`cuStreamWaitValue32`), `work(posted)` (optional) enqueues what reads it on
    /// `posted.stream` from `posted.ptr`, and the frame's release follows on the stream
    /// (`cuStreamWriteValue32`). Returns at once, without waiting for the frame: `Posted.wait`
    /// takes it on the host later, in order. Needs a GPU channel made with `ring=True` and
    /// every-frame delivery: `InvalidArgument` otherwise (a host channel has no stream), or more
    /// than 2**20 frames ahead of the last one received; what `work` raises (the release is
    /// enqueued anyway); `CudaError`. `Detached` once closed.
    #[pyo3(signature = (work=None))]
    fn post(slf: &Bound<'_, Self>, work: Option<&Bound<'_, PyAny>>) -> PyResult<Py<Posted>> {
        let py = slf.py();
        let c = slf.get().get(py)?;
        posted::post(py, &slf.get().inner, &c, work)
    }
    /// The next frame if one is ready now, else `None`. `Detached` once closed.
    fn try_recv(&self, py: Python<'_>) -> PyResult<Option<Frame>> {
        let c = self.get(py)?;
        let got = py.detach(|| {
            // Another receive waiting now takes a frame that is ready: none for this one.
            let Ok(_one) = self.receiving.try_lock() else {
                return Ok(None);
            };
            if let Some(f) = self.take_abandoned() {
                return self.hand_out(f).map(Some);
            }
            match OwnedFrame::try_recv(&c)? {
                Some(f) => self.hand_out(f).map(Some),
                None => Ok(None),
            }
        });
        match got {
            Ok(f) => f.map(|f| Frame::new(py, f, self.stream)).transpose(),
            Err(Stop::Failed(e)) => Err(err(py, e)),
            Err(Stop::Closed) => Err(detached(py)),
        }
    }

    /// The channel's counters as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.get(py)?.stats();
        stats_dict(py, &s)
    }

    /// The consumer's stream (a raw `CUstream`): frames are ready on it. `NotSupported` on a host
    /// channel, which has no stream.
    #[getter]
    fn stream(&self, py: Python<'_>) -> PyResult<usize> {
        let c = self.get(py)?;
        if c.is_host() {
            return Err(errors::not_supported(
                "a host-memory channel has no stream: its frames are ready when received",
            ));
        }
        let stream = c.stream().map_err(|e| errors::to_py(py, &e))?;
        Ok(stream.as_raw() as usize)
    }

    /// Whether the channel's pool is shared host memory (made with `memory="host"`).
    #[getter]
    fn is_host(&self, py: Python<'_>) -> PyResult<bool> {
        Ok(self.get(py)?.is_host())
    }

    /// Detaches. Frames (and their DLPack tensors) still alive keep the slot until they go. A
    /// thread blocked in `recv()` (or iterating) raises `Detached` within 50 ms; the slot is
    /// given back once it has. Never waits for that thread. In a forked child it detaches nothing:
    /// the slot is the parent's consumer's.
    fn close(&self, py: Python<'_>) {
        if self.fork.inherited() {
            return; // a forked child's copy: the parent's consumer stays attached
        }
        let c = lock(&self.inner).take();
        // Parked frames are released with it (a coroutine still to claim one raises `Detached`).
        let parked = std::mem::take(&mut *lock(&self.parked));
        py.detach(|| {
            drop(parked);
            drop(c)
        });
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) {
        self.close(py)
    }

    fn __iter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// The next frame; the iteration ends when the channel closes.
    fn __next__(&self, py: Python<'_>) -> PyResult<Option<Frame>> {
        match self.recv(py, None) {
            Ok(f) => Ok(Some(f)),
            Err(e) if e.is_instance_of::<errors::ChannelClosed>(py) => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn __repr__(&self) -> String {
        format!("Consumer({:?})", self.name)
    }
}
