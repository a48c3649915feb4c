//! The `WriteFrame` class.

use crate::args::{Int, bytes_of, opt_int, stream_arg};
use crate::lending::Lender;
use crate::util::{HOST_WRITE_FRAME, copy, cupy_array, err, lock, torch_tensor};
use crate::view::Buffer;
use crate::{dlpack, errors};
use cuda_ipc::channel::owned::OwnedWriteFrame;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use std::sync::{Arc, Mutex};

/// A buffer being written; `publish(metadata)` hands it to the consumers.
///
/// In a child made by `fork()` after the parent acquired it, the frame is the parent's: every call
/// that writes, reads, orders, publishes or hands out its buffer (its address, stream, DLPack and
/// `__cuda_array_interface__` included) raises `NotSupported`, taking no lock; `abandon()`, the
/// end of a `with` block and its collection do nothing (the parent publishes or abandons it);
/// `index`, `nbytes` and `is_host` describe the copy.
#[pyclass(module = "cuda_ipc", frozen)]
pub(crate) struct WriteFrame {
    inner: Mutex<Option<OwnedWriteFrame>>,
    /// Raw streams the publish is ordered after (`publish_after`, `__dlpack__(stream=)`, the
    /// producer's `stream=`).
    after: Mutex<Vec<usize>>,
    /// The producer's loan, given back when this frame ends.
    producer: Arc<Lender>,
    index: usize,
    /// Its length and where it is (host or GPU).
    buffer: Buffer,
}

impl WriteFrame {
    pub(crate) fn new(
        py: Python<'_>,
        producer: Arc<Lender>,
        f: OwnedWriteFrame,
    ) -> PyResult<WriteFrame> {
        let w = f.frame();
        let index = w.index();
        let buffer = Buffer::of(w.view(), HOST_WRITE_FRAME, "channel write frame");
        let other = producer.stream;
        let w = WriteFrame {
            inner: Mutex::new(Some(f)),
            after: Mutex::new(Vec::new()),
            producer,
            index,
            buffer,
        };
        if let Some(s) = other {
            // The producer's `stream=`: writes go there, so it waits first for the buffer's last
            // readers, and the publish after it. (On an error the frame drops: the buffer goes
            // back.)
            w.order_after(py, s)?;
        }
        Ok(w)
    }

    /// Runs `op` (a copy of `n` bytes) on the open frame; `InvalidArgument` once published or
    /// abandoned. A copy of at least [`crate::util::COPY_WITHOUT_GIL`] bytes runs without the
    /// GIL and takes the frame's lock there: the lock is never held by a thread that waits for
    /// the GIL (a thread with the GIL may wait for the lock, which such a copy lets go of
    /// without it). Taking it with the GIL and then letting the GIL go for the copy deadlocked a
    /// second thread's call on this frame: it held the GIL and waited for the lock, the copy
    /// held the lock and waited for the GIL.
    fn with_frame(
        &self,
        py: Python<'_>,
        n: usize,
        op: impl FnOnce(&mut OwnedWriteFrame) -> cuda_ipc::Result<()> + Send,
    ) -> PyResult<()> {
        // `&mut`: an `OwnedWriteFrame` may move between threads but is not shared between them.
        let run = || match lock(&self.inner).as_mut() {
            Some(f) => op(f).map(Some),
            None => Ok(None),
        };
        match copy(py, n, run) {
            Ok(Some(())) => Ok(()),
            Ok(None) => Err(Self::done(py)),
            Err(e) => Err(err(py, e)),
        }
    }

    pub(crate) fn finish(&self, py: Python<'_>) -> Option<OwnedWriteFrame> {
        let _ = py;
        lock(&self.inner).take()
    }

    pub(crate) fn done(py: Python<'_>) -> PyErr {
        errors::invalid_argument(
            py,
            "this frame was already published or abandoned".to_string(),
        )
    }

    /// Notes that the publish must come after work on raw stream `s`, and makes `s` wait for the
    /// buffer's last readers the first time (`WriteFrame::ready_on`): writes on `s` follow.
    pub(crate) fn order_after(&self, py: Python<'_>, s: usize) -> PyResult<()> {
        let mut after = lock(&self.after);
        if self.buffer.device().is_some_and(|g| g.stream != s) && !after.contains(&s) {
            let g = lock(&self.inner);
            let f = g.as_ref().ok_or_else(|| Self::done(py))?;
            // SAFETY: `s` is a stream the user (or a DLPack consumer) named for this producer's
            // device, valid while it writes the frame (python/README.md).
            unsafe { f.frame().ready_on_raw(s as _) }.map_err(|e| err(py, e))?;
            after.push(s);
        }
        Ok(())
    }
}

impl Drop for WriteFrame {
    fn drop(&mut self) {
        if self.buffer.is_forked_copy() {
            // A forked child's copy: the buffer and the loan are the parent's. Its fields' drops
            // act on nothing of theirs (`identity::fork`); neither the frame's lock nor the
            // lender's is taken, which a thread of the parent may have held at the fork.
            return;
        }
        // The lock is let go of before the GIL is taken (`give_back`).
        let taken = lock(&self.inner).take();
        if let Some(f) = taken {
            // Collected unpublished: the buffer goes back, the producer to its lender (its Python
            // `Producer` may be gone already).
            let p = f.into_producer();
            Python::attach(|py| self.producer.give_back(py, p, false));
        }
    }
}

#[pymethods]
impl WriteFrame {
    /// Index of the buffer in the pool.
    #[getter]
    fn index(&self) -> usize {
        self.index
    }
    /// Device address of the buffer; `NotSupported` on a host channel and in a forked child.
    #[getter]
    fn ptr(&self) -> PyResult<u64> {
        Ok(self.buffer.gpu()?.ptr)
    }
    /// Size of the buffer in bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.buffer.nbytes
    }
    /// The producer's stream (a raw `CUstream`): enqueue the write there. `NotSupported` on a host
    /// channel and in a forked child.
    #[getter]
    fn stream(&self) -> PyResult<usize> {
        Ok(self.buffer.gpu()?.stream)
    }
    /// Whether the buffer is shared host memory (`memory="host"`).
    #[getter]
    fn is_host(&self) -> bool {
        self.buffer.is_host()
    }

    /// Copies `data` (`bytes`, or any object exporting a buffer) into the host buffer at byte
    /// `offset`; returns the number of bytes written. `InvalidArgument` past the buffer's end or
    /// once published; `NotSupported` on a GPU channel and in a forked child.
    #[pyo3(signature = (data, offset=Int::Small(0)), text_signature = "($self, data, offset=0)")]
    fn write(&self, py: Python<'_>, data: &Bound<'_, PyAny>, offset: Int) -> PyResult<usize> {
        let offset: usize = offset.get(py, "offset")?;
        // A GPU frame first (`NotSupported`), before `data`'s buffer is asked for: a device
        // array's library may refuse the buffer protocol with an error of its own.
        self.buffer.host_range(py, offset, Some(0))?;
        let data = bytes_of(data)?;
        let src = data.as_bytes();
        self.buffer.host_range(py, offset, Some(src.len()))?;
        self.with_frame(py, src.len(), |f| f.write_at(offset, src))?;
        Ok(src.len())
    }

    /// A copy of `n` bytes of the host buffer from byte `offset` (`n=None`: to the end).
    /// `InvalidArgument` past the buffer's end or once published; `NotSupported` on a GPU channel
    /// and in a forked child.
    #[pyo3(signature = (offset=Int::Small(0), n=None), text_signature = "($self, offset=0, n=None)")]
    fn read<'py>(
        &self,
        py: Python<'py>,
        offset: Int,
        n: Option<Int>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let offset: usize = offset.get(py, "offset")?;
        let n = self.buffer.host_range(py, offset, opt_int(py, "n", n)?)?;
        PyBytes::new_with(py, n, |buf| {
            self.with_frame(py, n, move |f| f.frame().read_at(offset, buf))
        })
    }

    /// Orders the publish after the work enqueued on `stream` (an int `CUstream`, a
    /// `torch.cuda.Stream`, a `cupy.cuda.Stream`) by the time `publish` is called: write the
    /// buffer there, then publish. `__dlpack__(stream=s)` (what `torch.from_dlpack` and
    /// `as_tensor` do) notes `s` the same way. `NotSupported` on a host channel and in a forked
    /// child.
    fn publish_after(&self, py: Python<'_>, stream: &Bound<'_, PyAny>) -> PyResult<()> {
        self.buffer.gpu()?;
        if lock(&self.inner).is_none() {
            return Err(Self::done(py));
        }
        if let Some(s) = stream_arg(py, Some(stream))? {
            self.order_after(py, s)?;
        }
        Ok(())
    }

    /// Publishes the frame with `metadata` (at most 256 bytes: `bytes` or any object exporting a
    /// buffer, `bytearray`, `memoryview`, `array`, NumPy, read as `TensorUpdate.commit` reads its
    /// `content`; `None` or nothing: none); returns its sequence number.
    /// On a GPU channel the consumers' streams wait for the work enqueued so far on the
    /// producer's stream and on every stream noted by `publish_after` or `__dlpack__(stream=)`.
    /// `ChannelClosed` once the producer was closed: the frame goes back unpublished. A refused
    /// argument (`InvalidArgument` for metadata over 256 bytes or a buffer of Python objects,
    /// `TypeError` for what exports no buffer, a `str` or an `int`) changes nothing: the frame
    /// stays open, to publish again or abandon. `NotSupported` in a forked child, which changes
    /// nothing either (the frame is the parent's).
    #[pyo3(signature = (metadata=None))]
    #[pyo3(text_signature = "($self, metadata=None)")]
    fn publish(&self, py: Python<'_>, metadata: Option<&Bound<'_, PyAny>>) -> PyResult<u64> {
        // First: the producer's state and the frame's lock may be held for good in a forked child.
        self.buffer.check_fork()?;
        let metadata = metadata.map(bytes_of).transpose()?;
        let metadata = metadata.as_ref().map_or(&[][..], |b| b.as_bytes());
        // Checked before the frame is consumed (the library's publish checks it too, but only
        // once the frame is taken, which would lose it).
        if metadata.len() > cuda_ipc::channel::META_BYTES {
            return Err(errors::invalid_argument(
                py,
                format!(
                    "metadata is {}; at most {} (the frame is still open: publish it again or \
                     abandon it)",
                    crate::errors::bytes(metadata.len()),
                    cuda_ipc::channel::META_BYTES
                ),
            ));
        }
        let producer = &self.producer;
        if producer.is_closed() {
            self.abandon(py);
            return Err(producer.closed_error());
        }
        {
            let g = lock(&self.inner);
            let Some(f) = g.as_ref() else {
                return Err(Self::done(py));
            };
            for &s in lock(&self.after).iter() {
                // SAFETY: `s` is a stream the user (or a DLPack consumer) named for this
                // producer's device, valid while it writes the frame (python/README.md).
                unsafe { f.frame().publish_after_raw(s as _) }.map_err(|e| err(py, e))?;
            }
        }
        let Some(f) = self.finish(py) else {
            return Err(Self::done(py));
        };
        let (p, seq) = f.publish(metadata);
        producer.give_back(py, p, false);
        seq.map_err(|e| err(py, e))
    }

    /// Gives the buffer back unpublished (also what leaving a `with` block without publishing does).
    /// In a forked child it does nothing: the buffer is the parent's to publish or abandon.
    fn abandon(&self, py: Python<'_>) {
        if self.buffer.is_forked_copy() {
            return;
        }
        if let Some(f) = self.finish(py) {
            self.producer.give_back(py, f.into_producer(), false);
        }
    }

    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let gpu = self.buffer.gpu()?;
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
        // The capsule cannot own the write frame (publishing consumes it): it views the buffer,
        // valid until publish or abandon.
        let gpu = self.buffer.gpu()?;
        if lock(&self.inner).is_none() {
            return Err(Self::done(py));
        }
        let ex = dlpack::Export {
            hold: dlpack::Hold::None,
            ptr: gpu.ptr,
            nbytes: self.buffer.nbytes,
            dtype: dlpack::BYTES,
            device: gpu.device,
            ready_on: gpu.stream,
            frame: None,
            target: Mutex::new(None),
        };
        let capsule = ex.export(py, stream, max_version, dl_device, copy)?;
        if let Some(s) = *lock(&ex.target) {
            self.order_after(py, s)?;
        }
        Ok(capsule)
    }

    /// The buffer as a PyTorch tensor (zero-copy, through DLPack on PyTorch's current stream,
    /// which the publish is then ordered after): `dtype` (a `torch.dtype`, default `uint8`) and
    /// `shape` (an int or a tuple; default: the whole buffer, one-dimensional) over the first
    /// `prod(shape) * itemsize` bytes. `InvalidArgument` when they need more bytes than the
    /// buffer has; `NotSupported` on a host channel and in a forked child; `ImportError` without
    /// PyTorch.
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

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) {
        self.abandon(py)
    }
}
