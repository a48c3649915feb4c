//! The `Frame` class.

use crate::args::{Int, opt_int, stream_arg};
use crate::util::{HOST_FRAME, copy, cupy_array, err, lock, torch_tensor};
use crate::view::Buffer;
use crate::{dlpack, errors};
use cuda_ipc::channel::owned::OwnedFrame;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use std::sync::{Arc, Mutex};

/// A received frame. `release()`, leaving a `with` block, or collection ends this object's hold;
/// DLPack tensors made from it hold it until they are freed.
///
/// In a child made by `fork()` after the parent received it, the hold is the parent's: every call
/// that reads, orders or hands out the buffer (its address, stream, bytes, DLPack and
/// `__cuda_array_interface__`) and `held` raise `NotSupported`; `release()`, the end of a `with`
/// block and its collection do nothing (the parent's hold stays); `seq`, `index`, `metadata`,
/// `nbytes` and `is_host` describe the copy.
#[pyclass(module = "cuda_ipc", frozen)]
pub(crate) struct Frame {
    inner: Mutex<Option<Arc<OwnedFrame>>>,
    /// Raw streams the release is ordered after (`ready_on`, the consumer's `stream=`).
    after: Mutex<Vec<usize>>,
    seq: u64,
    index: usize,
    metadata: Vec<u8>,
    /// Its length and where it is (host or GPU).
    buffer: Buffer,
}

impl Frame {
    /// Wraps `f`; with `stream`, makes it ready there (`ready_on`), or releases it and raises.
    pub(crate) fn new(py: Python<'_>, f: OwnedFrame, stream: Option<usize>) -> PyResult<Frame> {
        let frame = Self::wrap(f);
        if let Some(s) = stream {
            frame.ready_on_raw(py, s)?;
        }
        Ok(frame)
    }

    pub(crate) fn wrap(f: OwnedFrame) -> Frame {
        let fr = f.frame();
        let buffer = Buffer::of(fr.view(), HOST_FRAME, "channel frame");
        Frame {
            seq: fr.seq(),
            index: fr.index(),
            metadata: fr.metadata().to_vec(),
            buffer,
            inner: Mutex::new(Some(Arc::new(f))),
            after: Mutex::new(Vec::new()),
        }
    }

    /// `ready_on` for raw stream `s`: on failure the frame is released and the error raised.
    pub(crate) fn ready_on_raw(&self, py: Python<'_>, s: usize) -> PyResult<()> {
        let gpu = self.buffer.gpu()?;
        let hold = self.hold(py)?;
        if s == gpu.stream {
            return Ok(());
        }
        // SAFETY: `s` is a stream the user named for this consumer's device (python/README.md:
        // it must stay valid until the frame is released).
        if let Err(e) = unsafe { hold.frame().ready_on_raw(s as _) } {
            drop(hold);
            self.release(py)?;
            return Err(err(py, e));
        }
        let mut after = lock(&self.after);
        if !after.contains(&s) {
            after.push(s);
        }
        Ok(())
    }

    /// The frame's hold, or `InvalidArgument` once released.
    pub(crate) fn hold(&self, py: Python<'_>) -> PyResult<Arc<OwnedFrame>> {
        lock(&self.inner)
            .clone()
            .ok_or_else(|| errors::invalid_argument(py, "this frame was released".to_string()))
    }
}

#[pymethods]
impl Frame {
    /// Sequence number (1, 2, ... per channel).
    #[getter]
    fn seq(&self) -> u64 {
        self.seq
    }
    /// Index of the buffer in the pool.
    #[getter]
    fn index(&self) -> usize {
        self.index
    }
    /// The producer's metadata.
    #[getter]
    fn metadata<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.metadata)
    }
    /// Device address of the buffer in this process; `NotSupported` on a host channel and in a
    /// forked child.
    #[getter]
    fn ptr(&self) -> PyResult<u64> {
        Ok(self.buffer.gpu()?.ptr)
    }
    /// Size of the buffer in bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.buffer.nbytes
    }
    /// The consumer's stream (a raw `CUstream`) on which the frame is ready; `NotSupported` on a
    /// host channel and in a forked child.
    #[getter]
    fn stream(&self) -> PyResult<usize> {
        Ok(self.buffer.gpu()?.stream)
    }
    /// Whether the buffer is shared host memory (`memory="host"`).
    #[getter]
    fn is_host(&self) -> bool {
        self.buffer.is_host()
    }

    /// A copy of `n` bytes of the host buffer from byte `offset` (`n=None`: to the end), taken
    /// while the frame is held. `InvalidArgument` past the buffer's end or once released;
    /// `NotSupported` on a GPU channel and in a forked child.
    #[pyo3(signature = (offset=Int::Small(0), n=None), text_signature = "($self, offset=0, n=None)")]
    fn read<'py>(
        &self,
        py: Python<'py>,
        offset: Int,
        n: Option<Int>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let offset: usize = offset.get(py, "offset")?;
        let n = self.buffer.host_range(py, offset, opt_int(py, "n", n)?)?;
        // This clone keeps the frame held through the copy, whatever another thread releases.
        let hold = self.hold(py)?;
        PyBytes::new_with(py, n, |buf| {
            copy(py, n, || hold.frame().read_at(offset, buf)).map_err(|e| err(py, e))
        })
    }

    /// A copy of the whole host buffer (`read()`); `bytes(frame)` is the same.
    fn bytes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        self.read(py, Int::Small(0), None)
    }

    fn __bytes__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        self.read(py, Int::Small(0), None)
    }
    /// True until `release()`. `NotSupported` in a forked child (the hold is the parent's).
    #[getter]
    fn held(&self) -> PyResult<bool> {
        self.buffer.check_fork()?;
        Ok(lock(&self.inner).is_some())
    }

    /// Ends this object's hold (the frame is released once no DLPack tensor of it is left),
    /// ordered after the work enqueued by now on every stream named by `ready_on` or the
    /// consumer's `stream=`. A second call does nothing, and so does a call in a forked child: the
    /// hold is the parent's (no stream is ordered there either).
    fn release(&self, py: Python<'_>) -> PyResult<()> {
        if self.buffer.is_forked_copy() {
            return Ok(());
        }
        let Some(f) = lock(&self.inner).take() else {
            return Ok(());
        };
        let after = std::mem::take(&mut *lock(&self.after));
        let mut failed = None;
        for s in after {
            // SAFETY: as in `ready_on_raw`: `s` is still valid (python/README.md).
            if let Err(e) = unsafe { f.frame().release_after_raw(s as _) } {
                failed = Some(e);
            }
        }
        let ctx = failed
            .as_ref()
            .and_then(|_| f.consumer().context().ok().cloned());
        py.detach(|| {
            if let Some(ctx) = &ctx {
                // Unordered, the producer could overwrite the buffer under work still queued on
                // that stream: wait for the context's work on the host before the release.
                let _ = ctx.synchronize();
            }
            drop(f)
        });
        match failed {
            Some(e) => Err(err(py, e)),
            None => Ok(()),
        }
    }

    /// Makes `stream` (an int `CUstream`, a `torch.cuda.Stream`, a `cupy.cuda.Stream`) wait on
    /// the GPU for this frame, and orders the release after the work enqueued there by the time
    /// of `release()`. `stream` must stay valid until then. `NotSupported` on a host channel and
    /// in a forked child; `InvalidArgument` once released; on a CUDA error the frame is released
    /// and the error raised.
    fn ready_on(&self, py: Python<'_>, stream: &Bound<'_, PyAny>) -> PyResult<()> {
        self.buffer.gpu()?;
        match stream_arg(py, Some(stream))? {
            Some(s) => self.ready_on_raw(py, s),
            None => Ok(()),
        }
    }

    /// The buffer as a PyTorch tensor (zero-copy, through DLPack on PyTorch's current stream; the
    /// tensor holds the frame until freed and its release is ordered after that stream): `dtype`
    /// (a `torch.dtype`, default `uint8`) and `shape` (an int or a tuple; default: the whole
    /// buffer, one-dimensional) over the first `prod(shape) * itemsize` bytes. `InvalidArgument`
    /// when they need more bytes than the buffer has or once released; `NotSupported` on a host
    /// channel and in a forked child; `ImportError` without PyTorch.
    #[pyo3(signature = (shape=None, dtype=None))]
    fn as_tensor<'py>(
        slf: &Bound<'py, Self>,
        shape: Option<&Bound<'py, PyAny>>,
        dtype: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        slf.get().buffer.gpu()?;
        torch_tensor(slf.as_any(), slf.get().buffer.nbytes, shape, dtype)
    }

    /// The buffer as a CuPy array, as `as_tensor` (CuPy's current stream; `dtype` anything
    /// `cupy.dtype` takes).
    #[pyo3(signature = (shape=None, dtype=None))]
    fn as_cupy<'py>(
        slf: &Bound<'py, Self>,
        shape: Option<&Bound<'py, PyAny>>,
        dtype: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        slf.get().buffer.gpu()?;
        cupy_array(slf.as_any(), slf.get().buffer.nbytes, shape, dtype)
    }

    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let gpu = self.buffer.gpu()?;
        self.hold(py)?;
        dlpack::cuda_array_interface(py, gpu.ptr, self.buffer.nbytes, false, gpu.stream)
    }

    fn __dlpack_device__(&self) -> PyResult<(i32, i32)> {
        Ok((dlpack::KDL_CUDA, self.buffer.gpu()?.device))
    }

    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__(
        &self,
        py: Python<'_>,
        stream: Option<&Bound<'_, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(u32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        // Checked first: `context()` panics on a host channel.
        let gpu = self.buffer.gpu()?;
        let hold = self.hold(py)?;
        let ex = dlpack::Export {
            hold: dlpack::Hold::Frame(dlpack::FrameHold {
                frame: hold.clone(),
                release_after: None,
            }),
            ptr: gpu.ptr,
            nbytes: self.buffer.nbytes,
            dtype: dlpack::BYTES,
            device: gpu.device,
            ready_on: gpu.stream,
            frame: Some(hold),
            target: Mutex::new(None),
        };
        ex.export(py, stream, max_version, dl_device, copy)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<()> {
        self.release(py)
    }

    fn __repr__(&self) -> String {
        format!(
            "Frame(seq={}, index={}, nbytes={}, metadata={}{})",
            self.seq,
            self.index,
            self.buffer.nbytes,
            crate::errors::bytes(self.metadata.len()),
            if self.buffer.is_host() { ", host" } else { "" }
        )
    }
}
