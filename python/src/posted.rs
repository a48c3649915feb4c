//! The `Posted` class (a receive posted ahead, `Consumer.post`) and what its wait returns,
//! `PostedFrame`.

use crate::args::{Seconds, timeout_arg};
use crate::errors::detached;
use crate::util::{Stop, err, lock, sliced, timeout_error};
use crate::{aio, errors};
use cuda_ipc::channel::owned::OwnedPosted;
use cuda_ipc::driver::DeviceMemory;
use cuda_ipc::identity::ForkEpoch;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A Python `Consumer`'s Rust consumer, `None` once it was closed: shared with the receives
/// posted on it, which stop waiting (`Detached`) once it is closed.
pub(crate) type ConsumerSlot = Arc<Mutex<Option<Arc<cuda_ipc::channel::Consumer>>>>;

/// A receive posted ahead (`cuda_ipc::channel::owned::OwnedPosted`): this consumer's stream
/// waits on the GPU for frame `seq`, which will be in buffer `index` at `ptr` (`nbytes` long).
/// `wait()` takes the frame on the host; dropping this without waiting leaves the frame to the
/// next `wait` or `recv`.
///
/// In a child made by `fork()` after the parent posted it, the receive, its stream and its
/// addresses are the parent's: `wait`, `wait_async` (awaited), `ptr`, `stream` and `gate_ptr`
/// raise `NotSupported`, taking no lock; `seq`, `index` and `nbytes` describe the copy.
#[pyclass(module = "cuda_ipc", frozen)]
pub(crate) struct Posted {
    /// `None` while `work` runs (the receive is not posted yet) and once the frame came.
    inner: Mutex<Option<OwnedPosted>>,
    /// The frame once it came, until a wait claims it (locked inside `inner`'s lock where both
    /// are held).
    arrived: Mutex<Option<PostedFrame>>,
    /// The consumer's slot (see [`ConsumerSlot`]).
    consumer: ConsumerSlot,
    seq: u64,
    index: usize,
    ptr: u64,
    nbytes: usize,
    stream: usize,
    gate_ptr: u64,
    /// The process (by fork) that posted it: a forked child's calls raise `NotSupported` before
    /// taking `inner` or `arrived`, which a parent's wait holds through its slices.
    fork: ForkEpoch,
}

/// `Consumer.post`: posts on `c` (the Rust consumer in `consumer`), calling `work(posted)` with
/// the object returned (its `wait` raises until `post` returned).
pub(crate) fn post(
    py: Python<'_>,
    consumer: &ConsumerSlot,
    c: &std::sync::Arc<cuda_ipc::channel::Consumer>,
    work: Option<&Bound<'_, PyAny>>,
) -> PyResult<Py<Posted>> {
    // What `work` raised (or the making of the object), raised again once `post` returned; the
    // library sees a plain error.
    let mut raised: Option<PyErr> = None;
    let mut made: Option<Py<Posted>> = None;
    let got = OwnedPosted::post(c, |p| {
        let buffer = p.buffer()?;
        let info = Posted {
            inner: Mutex::new(None),
            arrived: Mutex::new(None),
            consumer: consumer.clone(),
            seq: p.seq(),
            index: p.index(),
            ptr: buffer.device_ptr(),
            nbytes: buffer.len(),
            stream: p.stream()?.as_raw() as usize,
            gate_ptr: p.gate_device_ptr()?,
            fork: ForkEpoch::now(),
        };
        let r = Py::new(py, info).and_then(|obj| {
            made = Some(obj.clone_ref(py));
            match work {
                Some(w) => w.call1((obj,)).map(|_| ()),
                None => Ok(()),
            }
        });
        r.map_err(|e| {
            raised = Some(e);
            cuda_ipc::Error::InvalidArgument("the posted receive's work raised".into())
        })
    });
    if let Some(e) = raised {
        return Err(e);
    }
    let owned = got.map_err(|e| err(py, e))?;
    let Some(p) = made else {
        // Never: `post` returned Ok, so it called the closure, which sets `made`.
        return Err(errors::invalid_argument(
            py,
            "the posted receive was not made".to_string(),
        ));
    };
    *lock(&p.get().inner) = Some(owned);
    Ok(p)
}

impl Posted {
    /// `NotSupported` in a process forked from the one that posted the receive.
    fn check_fork(&self) -> PyResult<()> {
        errors::check_fork(self.fork, "posted receive")
    }

    /// Waits (as `wait`, stopping with `Detached` also once the consumer was closed or
    /// `cancelled` raised) until the frame is in `arrived`: put there by this wait, or earlier by
    /// one whose awaiting side gave up (an awaitable cancelled in the slice its frame came in).
    /// The frame is moved there under the `inner` lock, so that a wait that finds `inner` empty
    /// always finds the frame, unless another wait claimed it already.
    fn park(
        &self,
        py: Python<'_>,
        timeout: Option<Duration>,
        cancelled: Option<&AtomicBool>,
    ) -> PyResult<()> {
        self.check_fork()?;
        let got = sliced(
            py,
            timeout,
            || lock(&self.consumer).is_none() || cancelled.is_some_and(aio::is_cancelled),
            detached,
            |slice| {
                let mut inner = lock(&self.inner);
                let Some(p) = inner.as_ref() else {
                    return if lock(&self.arrived).is_some() {
                        Ok(Some(()))
                    } else {
                        Err(Stop::Failed(self.waited_for_already()))
                    };
                };
                let Some(f) = p.wait(Some(slice))?.map(|f| PostedFrame {
                    seq: f.seq(),
                    index: f.index(),
                    metadata: f.metadata().to_vec(),
                }) else {
                    return Ok(None);
                };
                *lock(&self.arrived) = Some(f);
                // The receive is done: a later wait finds the frame in `arrived` (until it is
                // claimed), then an error, never a wait for nothing. Dropped without the GIL
                // (`sliced` runs this step detached).
                let done = inner.take();
                drop(inner);
                drop(done);
                Ok(Some(()))
            },
        )?;
        got.ok_or_else(|| timeout_error(py, "a posted frame", timeout))
    }

    /// Takes the frame a wait put in `arrived`.
    fn claim(&self, py: Python<'_>) -> PyResult<PostedFrame> {
        self.check_fork()?;
        lock(&self.arrived)
            .take()
            .ok_or_else(|| err(py, self.waited_for_already()))
    }

    /// The error of a wait for a frame that another wait took.
    fn waited_for_already(&self) -> cuda_ipc::Error {
        cuda_ipc::Error::InvalidArgument(format!(
            "frame {} was waited for already, or its post() has not returned",
            self.seq
        ))
    }
}

#[pymethods]
impl Posted {
    /// Waits on the host up to `timeout` seconds (`None`: forever) until the frame is published,
    /// and takes it (`Posted::wait`); frames posted before it and not waited for are taken on the
    /// way. Nothing is held afterwards (its release was enqueued when it was posted). Raises
    /// `Timeout` (it can be waited for again), `ProducerGone`, `ChannelClosed` (the frame never
    /// came), `Detached` once the consumer was closed, `InvalidArgument` when `recv` took the
    /// frame first or it was waited for already; `NotSupported` in a forked child.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<Seconds>) -> PyResult<PostedFrame> {
        let timeout = timeout_arg(py, timeout)?;
        self.park(py, timeout, None)?;
        self.claim(py)
    }

    /// `wait` as an awaitable: it waits on a thread of the extension's own executor (without the
    /// GIL), so the loop runs other tasks meanwhile; cancelling the awaiting task stops that
    /// thread within 50 ms and leaves the frame to a later wait, even one that came in those
    /// 50 ms (the thread only parks the frame; the awaiting coroutine claims it once awaited).
    #[pyo3(signature = (timeout=None))]
    fn wait_async<'py>(
        slf: Bound<'py, Self>,
        timeout: Option<Seconds>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let timeout = timeout_arg(py, timeout)?;
        let claim = slf.getattr("_claim")?.unbind();
        let this = slf.unbind();
        aio::awaitable_then(
            py,
            move |py, cancelled| {
                this.get().park(py, timeout, Some(cancelled))?;
                Ok(py.None())
            },
            claim,
        )
    }

    /// Takes the frame an awaitable wait parked (what `wait_async`'s coroutine returns once its
    /// thread is done); raises `InvalidArgument` when another wait took it.
    fn _claim(&self, py: Python<'_>) -> PyResult<PostedFrame> {
        self.claim(py)
    }

    /// The sequence number of the frame waited for.
    #[getter]
    fn seq(&self) -> u64 {
        self.seq
    }

    /// Index of the buffer that will hold it (`(seq - 1) % buffers`).
    #[getter]
    fn index(&self) -> usize {
        self.index
    }

    /// Device address of that buffer (a `CUdeviceptr`), valid in the consumer's context;
    /// `NotSupported` in a forked child.
    #[getter]
    fn ptr(&self) -> PyResult<u64> {
        self.check_fork()?;
        Ok(self.ptr)
    }

    /// Length of that buffer in bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.nbytes
    }

    /// The consumer's stream (a raw `CUstream`): work that reads the frame goes there (it waits
    /// for the frame), e.g. `torch.cuda.ExternalStream(posted.stream)`. `NotSupported` in a
    /// forked child.
    #[getter]
    fn stream(&self) -> PyResult<usize> {
        self.check_fork()?;
        Ok(self.stream)
    }

    /// Device address of the channel's gate words: work on the stream reads them to tell
    /// whether this frame came (`Consumer::gate_device_ptr`). `NotSupported` in a forked child.
    #[getter]
    fn gate_ptr(&self) -> PyResult<u64> {
        self.check_fork()?;
        Ok(self.gate_ptr)
    }

    fn __repr__(&self) -> String {
        format!("Posted(seq={}, index={})", self.seq, self.index)
    }
}

/// A posted frame taken on the host (`Posted.wait`): its number, buffer and metadata.
#[pyclass(module = "cuda_ipc", frozen)]
pub(crate) struct PostedFrame {
    seq: u64,
    index: usize,
    metadata: Vec<u8>,
}

#[pymethods]
impl PostedFrame {
    /// Its sequence number.
    #[getter]
    fn seq(&self) -> u64 {
        self.seq
    }

    /// Index of its buffer in the pool.
    #[getter]
    fn index(&self) -> usize {
        self.index
    }

    /// The producer's metadata for it (bytes).
    #[getter]
    fn metadata<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.metadata)
    }

    fn __repr__(&self) -> String {
        format!("PostedFrame(seq={}, index={})", self.seq, self.index)
    }
}
