//! `cuda_ipc`, the Python extension: [`Producer`], [`Consumer`] and their frames over the Rust
//! channel (`cuda_ipc::channel`), frames exported as DLPack capsules and through
//! `__cuda_array_interface__`, errors as the hierarchy of [`errors`].
//!
//! Ownership: a Python `Frame` holds an `Arc` of a [`OwnedFrame`], which keeps the Rust consumer
//! alive; every DLPack capsule made from it holds another `Arc`, so the hold ends when the frame is
//! released (or collected) *and* every tensor made from it is freed. A `WriteFrame` owns the Rust
//! producer while it is written ([`OwnedWriteFrame`]) and gives it back to its `Producer` on
//! `publish`, `abandon` or collection.
//!
//! Host channels (`memory="host"`, `cuda_ipc::channel::MemoryKind::Host`) never load the CUDA
//! driver. Their frames have no device pointer, stream or tensor export: every such accessor raises
//! `NotSupported` (checked here, so none of the Rust accessors that panic on a host channel is ever
//! called). Their bytes are copied in and out (`WriteFrame.write`, `Frame.bytes`, `Frame.read`),
//! never lent as a buffer: another process writes that memory once the frame is released, and a
//! Python buffer (a `memoryview`, a NumPy array) could outlive the hold with nothing to stop it; the
//! abi3 wheel (limited API of CPython 3.9) cannot export the buffer protocol either.
//!
//! Blocking calls release the GIL and wait in slices of at most [`SLICE`], checking for signals
//! between slices, so Ctrl-C raises `KeyboardInterrupt` promptly with nothing held.

mod dlpack;
mod errors;

use cuda_ipc::channel::owned::{OwnedFrame, OwnedWriteFrame};
use cuda_ipc::channel::{
    ChannelOptions, ChannelStats, ConsumerOptions, Delivery, MemoryKind, WaitStrategy,
};
use cuda_ipc::driver::{Device, DeviceMemory};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyMemoryView};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The longest a blocking call waits without the GIL before it checks for signals.
const SLICE: Duration = Duration::from_millis(50);

/// Copies of at least this many bytes of a host frame run without the GIL.
const COPY_WITHOUT_GIL: usize = 64 * 1024;

const HOST_WRITE_FRAME: &str = "a host-memory frame has no device buffer, stream or DLPack \
                                export: write it with write(data, offset) and read it with \
                                read(offset, n)";
const HOST_FRAME: &str = "a host-memory frame has no device buffer, stream or DLPack export: \
                          copy its bytes with bytes() or read(offset, n)";
const GPU_FRAME: &str = "a GPU frame has no host bytes: use its device buffer (ptr, DLPack, \
                         __cuda_array_interface__) on its stream";

fn err(py: Python<'_>, e: cuda_ipc::Error) -> PyErr {
    errors::to_py(py, &e)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Seconds (`None`: forever) as a `Duration`.
fn timeout_arg(py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<Duration>> {
    match timeout {
        None => Ok(None),
        Some(t) if t.is_finite() && t >= 0.0 => Ok(Some(Duration::from_secs_f64(t))),
        Some(t) => Err(errors::invalid_argument(
            py,
            format!("timeout must be a non-negative number of seconds or None, got {t}"),
        )),
    }
}

fn wait_arg(py: Python<'_>, wait: &str, spin: f64) -> PyResult<WaitStrategy> {
    match wait {
        "block" => Ok(WaitStrategy::Block),
        "spin" => Ok(WaitStrategy::Spin),
        "spin_then_block" if spin.is_finite() && spin >= 0.0 => {
            Ok(WaitStrategy::SpinThenBlock(Duration::from_secs_f64(spin)))
        }
        "spin_then_block" => Err(errors::invalid_argument(
            py,
            format!("spin must be a non-negative number of seconds, got {spin}"),
        )),
        w => Err(errors::invalid_argument(
            py,
            format!("wait must be \"block\", \"spin\" or \"spin_then_block\", got {w:?}"),
        )),
    }
}

fn memory_name(k: MemoryKind) -> &'static str {
    match k {
        MemoryKind::Legacy => "legacy",
        MemoryKind::Vmm => "vmm",
        MemoryKind::Pool => "pool",
        MemoryKind::Host => "host",
        _ => "auto",
    }
}

fn memory_arg(py: Python<'_>, memory: &str) -> PyResult<MemoryKind> {
    match memory {
        "auto" => Ok(MemoryKind::Auto),
        "legacy" => Ok(MemoryKind::Legacy),
        "vmm" => Ok(MemoryKind::Vmm),
        "pool" => Ok(MemoryKind::Pool),
        "host" => Ok(MemoryKind::Host),
        m => Err(errors::invalid_argument(
            py,
            format!(
                "memory must be \"auto\", \"legacy\", \"vmm\", \"pool\" or \"host\", got {m:?}"
            ),
        )),
    }
}

/// The counters of `ChannelStats` as a dict (`consumers`: a list of dicts).
fn stats_dict<'py>(py: Python<'py>, s: &ChannelStats) -> PyResult<Bound<'py, PyDict>> {
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

/// Runs `step` (one bounded wait of at most `slice`, without the GIL) until it yields a value, the
/// deadline passes (`Ok(None)`), or a signal handler raises (its exception, e.g.
/// `KeyboardInterrupt`).
fn sliced<T: Send>(
    py: Python<'_>,
    timeout: Option<Duration>,
    mut step: impl FnMut(Duration) -> Result<Option<T>, cuda_ipc::Error> + Send,
) -> PyResult<Option<T>> {
    let deadline = timeout.map(|t| Instant::now() + t);
    loop {
        let slice = match deadline {
            Some(d) => d.saturating_duration_since(Instant::now()).min(SLICE),
            None => SLICE,
        };
        if let Some(v) = py.detach(|| step(slice)).map_err(|e| err(py, e))? {
            return Ok(Some(v));
        }
        py.check_signals()?;
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(None);
        }
    }
}

fn timeout_error(py: Python<'_>, what: &'static str, after: Option<Duration>) -> PyErr {
    err(
        py,
        cuda_ipc::Error::Timeout {
            what,
            after: after.unwrap_or_default(),
        },
    )
}

/// The producing end of a channel (`cuda_ipc::channel::Producer`).
#[pyclass(module = "cuda_ipc", frozen)]
struct Producer {
    /// `None` while a `WriteFrame` owns it, or after `close()`.
    inner: Mutex<Option<Box<cuda_ipc::channel::Producer>>>,
    name: String,
    memory: MemoryKind,
    closed: Mutex<bool>,
}

impl Producer {
    fn take(&self, py: Python<'_>) -> PyResult<Box<cuda_ipc::channel::Producer>> {
        lock(&self.inner).take().ok_or_else(|| self.unavailable(py))
    }
    /// Why the Rust producer is not here: closed, or lent to a write frame.
    fn unavailable(&self, py: Python<'_>) -> PyErr {
        if *lock(&self.closed) {
            errors::CudaIpcError::new_err(format!(
                "the producer of channel {:?} is closed",
                self.name
            ))
        } else {
            errors::invalid_argument(
                py,
                "a WriteFrame of this producer is outstanding: publish or abandon it first"
                    .to_string(),
            )
        }
    }
    fn give_back(&self, p: Box<cuda_ipc::channel::Producer>) {
        *lock(&self.inner) = Some(p);
    }
}

#[pymethods]
impl Producer {
    /// Creates channel `name` with a pool of `buffers` buffers of `buffer_bytes` bytes on CUDA
    /// device `device` (its primary context); with `memory="host"`, of shared host memory
    /// (`Producer::create_host`: no CUDA driver needed, `device` unused).
    #[new]
    #[pyo3(signature = (name, buffer_bytes, *, buffers=4, max_consumers=8, quota_bytes=None,
        wait="spin_then_block", spin=50e-6, memory="auto", group_access=false, device=0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        name: String,
        buffer_bytes: usize,
        buffers: usize,
        max_consumers: usize,
        quota_bytes: Option<u64>,
        wait: &str,
        spin: f64,
        memory: &str,
        group_access: bool,
        device: usize,
    ) -> PyResult<Self> {
        let mut opts = ChannelOptions::new(buffer_bytes)
            .buffers(buffers)
            .max_consumers(max_consumers)
            .wait(wait_arg(py, wait, spin)?)
            .memory(memory_arg(py, memory)?)
            .group_access(group_access);
        if let Some(q) = quota_bytes {
            opts = opts.quota_bytes(q);
        }
        let host = memory == "host";
        let p = py
            .detach(|| {
                if host {
                    return cuda_ipc::channel::Producer::create_host(&name, &opts);
                }
                let ctx = Device::get(device)?.primary_context()?;
                cuda_ipc::channel::Producer::create(&ctx, &name, &opts)
            })
            .map_err(|e| err(py, e))?;
        Ok(Producer {
            memory: p.memory_kind(),
            inner: Mutex::new(Some(Box::new(p))),
            name,
            closed: Mutex::new(false),
        })
    }

    /// The channel name.
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// The kind of memory of the pool: "legacy", "vmm", "pool" or "host".
    #[getter]
    fn memory(&self) -> &'static str {
        memory_name(self.memory)
    }

    /// Takes a free buffer to write, waiting up to `timeout` seconds (`None`: forever).
    #[pyo3(signature = (timeout=None))]
    fn acquire(slf: &Bound<'_, Self>, timeout: Option<f64>) -> PyResult<WriteFrame> {
        let py = slf.py();
        let timeout = timeout_arg(py, timeout)?;
        let this = slf.get();
        let mut producer = Some(this.take(py)?);
        let got = sliced(py, timeout, |slice| {
            let p = producer.take().expect("producer present between slices");
            match OwnedWriteFrame::acquire(p, Some(slice)) {
                Ok(f) => Ok(Some(f)),
                Err((p, cuda_ipc::Error::Timeout { .. })) => {
                    producer = Some(p);
                    Ok(None)
                }
                Err((p, e)) => {
                    producer = Some(p);
                    Err(e)
                }
            }
        });
        if let Some(p) = producer.take() {
            this.give_back(p);
        }
        match got? {
            Some(f) => Ok(WriteFrame::new(slf.clone().unbind(), f)),
            None => Err(timeout_error(py, "a free buffer", timeout)),
        }
    }

    /// A free buffer if one is free now, else `None`.
    fn try_acquire(slf: &Bound<'_, Self>) -> PyResult<Option<WriteFrame>> {
        let py = slf.py();
        let this = slf.get();
        let p = this.take(py)?;
        match OwnedWriteFrame::acquire(p, Some(Duration::ZERO)) {
            Ok(f) => Ok(Some(WriteFrame::new(slf.clone().unbind(), f))),
            Err((p, cuda_ipc::Error::Timeout { .. })) => {
                this.give_back(p);
                Ok(None)
            }
            Err((p, e)) => {
                this.give_back(p);
                Err(err(py, e))
            }
        }
    }

    /// The channel's counters as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = match &*lock(&self.inner) {
            Some(p) => p.stats(),
            None => return Err(self.unavailable(py)),
        };
        stats_dict(py, &s)
    }

    /// Closes the channel: waits up to `timeout` seconds for consumers' holds, then frees the pool.
    /// Returns `{"forced_holds": n}`. Closing again does nothing.
    #[pyo3(signature = (timeout=5.0))]
    fn close<'py>(&self, py: Python<'py>, timeout: f64) -> PyResult<Bound<'py, PyDict>> {
        let t = timeout_arg(py, Some(timeout))?.unwrap_or_default();
        let d = PyDict::new(py);
        let p = lock(&self.inner).take();
        *lock(&self.closed) = true;
        if let Some(p) = p {
            let r = py.detach(|| p.close(t)).map_err(|e| err(py, e))?;
            d.set_item("forced_holds", r.forced_holds)?;
        } else {
            d.set_item("forced_holds", 0)?;
        }
        Ok(d)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<()> {
        self.close(py, 5.0).map(|_| ())
    }

    fn __repr__(&self) -> String {
        format!(
            "Producer({:?}, memory={:?})",
            self.name,
            memory_name(self.memory)
        )
    }
}

/// Where a GPU frame's buffer is; a host frame has none.
#[derive(Clone, Copy)]
struct DeviceView {
    ptr: u64,
    /// The raw stream the frame is written (write frame) or ready (received frame) on.
    stream: usize,
    device: i32,
}

/// `bytes` as is; anything else that exports a buffer (`bytearray`, `memoryview`, `array`, NumPy)
/// copied into `bytes` once. Raises `TypeError` for anything else (`str`, `int`).
fn bytes_of<'py>(data: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
    if let Ok(b) = data.cast::<PyBytes>() {
        return Ok(b.clone());
    }
    Ok(PyMemoryView::from(data)?
        .call_method0("tobytes")?
        .cast_into::<PyBytes>()?)
}

/// `n` bytes from `offset` of a `len`-byte buffer (`n`: `None` for the rest), or `InvalidArgument`.
fn range_arg(py: Python<'_>, offset: usize, n: Option<usize>, len: usize) -> PyResult<usize> {
    let n = n.unwrap_or_else(|| len.saturating_sub(offset));
    if offset.checked_add(n).is_none_or(|end| end > len) {
        return Err(errors::invalid_argument(
            py,
            format!("{n} bytes at offset {offset} pass the end of a {len}-byte buffer"),
        ));
    }
    Ok(n)
}

/// Runs `copy` without the GIL when it moves at least [`COPY_WITHOUT_GIL`] bytes.
fn copy<T: Send>(py: Python<'_>, n: usize, copy: impl FnOnce() -> T + Send) -> T {
    if n >= COPY_WITHOUT_GIL {
        py.detach(copy)
    } else {
        copy()
    }
}

/// A buffer being written; `publish(metadata)` hands it to the consumers.
#[pyclass(module = "cuda_ipc", frozen)]
struct WriteFrame {
    inner: Mutex<Option<OwnedWriteFrame>>,
    producer: Py<Producer>,
    index: usize,
    nbytes: usize,
    /// `None` on a host channel.
    gpu: Option<DeviceView>,
}

impl WriteFrame {
    fn new(producer: Py<Producer>, f: OwnedWriteFrame) -> WriteFrame {
        let w = f.frame();
        let index = w.index();
        // The GPU accessors (`buffer`, `stream`) panic on a host channel: only asked of GPU frames.
        let (nbytes, gpu) = if w.is_host() {
            (w.len(), None)
        } else {
            let view = DeviceView {
                ptr: w.buffer().device_ptr(),
                stream: w.stream().as_raw() as usize,
                device: w.buffer().context().device().ordinal() as i32,
            };
            (w.buffer().len(), Some(view))
        };
        WriteFrame {
            inner: Mutex::new(Some(f)),
            producer,
            index,
            nbytes,
            gpu,
        }
    }

    fn finish(&self, py: Python<'_>) -> Option<OwnedWriteFrame> {
        let _ = py;
        lock(&self.inner).take()
    }

    /// The device buffer, or `NotSupported` on a host channel.
    fn gpu(&self) -> PyResult<DeviceView> {
        self.gpu
            .ok_or_else(|| errors::not_supported(HOST_WRITE_FRAME))
    }

    fn done(py: Python<'_>) -> PyErr {
        errors::invalid_argument(
            py,
            "this frame was already published or abandoned".to_string(),
        )
    }
}

impl Drop for WriteFrame {
    fn drop(&mut self) {
        if let Some(f) = lock(&self.inner).take() {
            // Collected unpublished: the buffer goes back, the producer to its Python object.
            let p = f.into_producer();
            self.producer.get().give_back(p);
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
    /// Device address of the buffer; `NotSupported` on a host channel.
    #[getter]
    fn ptr(&self) -> PyResult<u64> {
        Ok(self.gpu()?.ptr)
    }
    /// Size of the buffer in bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.nbytes
    }
    /// The producer's stream (a raw `CUstream`): enqueue the write there. `NotSupported` on a host
    /// channel.
    #[getter]
    fn stream(&self) -> PyResult<usize> {
        Ok(self.gpu()?.stream)
    }
    /// Whether the buffer is shared host memory (`memory="host"`).
    #[getter]
    fn is_host(&self) -> bool {
        self.gpu.is_none()
    }

    /// Copies `data` (`bytes`, or any object exporting a buffer) into the host buffer at byte
    /// `offset`; returns the number of bytes written. `InvalidArgument` past the buffer's end or
    /// once published; `NotSupported` on a GPU channel.
    #[pyo3(signature = (data, offset=0))]
    fn write(&self, py: Python<'_>, data: &Bound<'_, PyAny>, offset: usize) -> PyResult<usize> {
        if self.gpu.is_some() {
            return Err(errors::not_supported(GPU_FRAME));
        }
        let data = bytes_of(data)?;
        let src = data.as_bytes();
        range_arg(py, offset, Some(src.len()), self.nbytes)?;
        let mut g = lock(&self.inner);
        let f = g.as_mut().ok_or_else(|| Self::done(py))?;
        copy(py, src.len(), || f.write_at(offset, src)).map_err(|e| err(py, e))?;
        Ok(src.len())
    }

    /// A copy of `n` bytes of the host buffer from byte `offset` (`n=None`: to the end).
    /// `InvalidArgument` past the buffer's end or once published; `NotSupported` on a GPU channel.
    #[pyo3(signature = (offset=0, n=None))]
    fn read<'py>(
        &self,
        py: Python<'py>,
        offset: usize,
        n: Option<usize>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        if self.gpu.is_some() {
            return Err(errors::not_supported(GPU_FRAME));
        }
        let n = range_arg(py, offset, n, self.nbytes)?;
        let mut g = lock(&self.inner);
        // `&mut`: an `OwnedWriteFrame` may move between threads but is not shared between them.
        let f = g.as_mut().ok_or_else(|| Self::done(py))?;
        PyBytes::new_with(py, n, |buf| {
            copy(py, n, move || f.frame().read_at(offset, buf)).map_err(|e| err(py, e))
        })
    }

    /// Publishes the frame with `metadata` (at most 256 bytes); returns its sequence number.
    #[pyo3(signature = (metadata=b"".as_slice()))]
    fn publish(&self, py: Python<'_>, metadata: &[u8]) -> PyResult<u64> {
        let Some(f) = self.finish(py) else {
            return Err(Self::done(py));
        };
        let (p, seq) = f.publish(metadata);
        self.producer.get().give_back(p);
        seq.map_err(|e| err(py, e))
    }

    /// Gives the buffer back unpublished (also what leaving a `with` block without publishing does).
    fn abandon(&self, py: Python<'_>) {
        if let Some(f) = self.finish(py) {
            self.producer.get().give_back(f.into_producer());
        }
    }

    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let gpu = self.gpu()?;
        dlpack::cuda_array_interface(py, gpu.ptr, self.nbytes, false, gpu.stream)
    }

    fn __dlpack_device__(&self) -> PyResult<(i32, i32)> {
        Ok((dlpack::KDL_CUDA, self.gpu()?.device))
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
        let gpu = self.gpu()?;
        if lock(&self.inner).is_none() {
            return Err(Self::done(py));
        }
        let ex = dlpack::Export {
            hold: dlpack::Hold::None,
            ptr: gpu.ptr,
            nbytes: self.nbytes,
            device: gpu.device,
            ready_on: gpu.stream,
            ctx: None,
        };
        ex.export(py, stream, max_version, dl_device, copy)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) {
        self.abandon(py)
    }
}

/// The consuming end of a channel (`cuda_ipc::channel::Consumer`).
#[pyclass(module = "cuda_ipc", frozen)]
struct Consumer {
    inner: Mutex<Option<Arc<cuda_ipc::channel::Consumer>>>,
    name: String,
}

impl Consumer {
    fn get(&self, py: Python<'_>) -> PyResult<Arc<cuda_ipc::channel::Consumer>> {
        lock(&self.inner)
            .clone()
            .ok_or_else(|| err(py, cuda_ipc::channel::ChannelError::Detached.into()))
    }
}

#[pymethods]
impl Consumer {
    /// Attaches to channel `name` on the device that holds its pool; receives frames published
    /// from now on.
    #[new]
    #[pyo3(signature = (name, *, delivery="every", wait="spin_then_block", spin=50e-6,
        group_access=false))]
    fn new(
        py: Python<'_>,
        name: String,
        delivery: &str,
        wait: &str,
        spin: f64,
        group_access: bool,
    ) -> PyResult<Self> {
        let delivery = match delivery {
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
        Ok(Consumer {
            inner: Mutex::new(Some(Arc::new(c))),
            name,
        })
    }

    /// The same as `Consumer(name, ...)`.
    #[classmethod]
    #[pyo3(signature = (name, *, delivery="every", wait="spin_then_block", spin=50e-6,
        group_access=false))]
    fn attach(
        _cls: &Bound<'_, pyo3::types::PyType>,
        py: Python<'_>,
        name: String,
        delivery: &str,
        wait: &str,
        spin: f64,
        group_access: bool,
    ) -> PyResult<Self> {
        Self::new(py, name, delivery, wait, spin, group_access)
    }

    /// The channel name.
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// Waits up to `timeout` seconds (`None`: forever) for the next frame.
    #[pyo3(signature = (timeout=None))]
    fn recv(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Frame> {
        let timeout = timeout_arg(py, timeout)?;
        let c = self.get(py)?;
        match sliced(py, timeout, |slice| OwnedFrame::recv(&c, Some(slice)))? {
            Some(f) => Ok(Frame::new(f)),
            None => Err(timeout_error(py, "a frame", timeout)),
        }
    }

    /// The next frame if one is ready now, else `None`.
    fn try_recv(&self, py: Python<'_>) -> PyResult<Option<Frame>> {
        let c = self.get(py)?;
        Ok(OwnedFrame::try_recv(&c)
            .map_err(|e| err(py, e))?
            .map(Frame::new))
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
        Ok(c.stream().as_raw() as usize)
    }

    /// Whether the channel's pool is shared host memory (made with `memory="host"`).
    #[getter]
    fn is_host(&self, py: Python<'_>) -> PyResult<bool> {
        Ok(self.get(py)?.is_host())
    }

    /// Detaches. Frames (and their DLPack tensors) still alive keep the slot until they go.
    fn close(&self, py: Python<'_>) {
        let c = lock(&self.inner).take();
        py.detach(|| drop(c));
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

/// A received frame. `release()`, leaving a `with` block, or collection ends this object's hold;
/// DLPack tensors made from it hold it until they are freed.
#[pyclass(module = "cuda_ipc", frozen)]
struct Frame {
    inner: Mutex<Option<Arc<OwnedFrame>>>,
    seq: u64,
    index: usize,
    metadata: Vec<u8>,
    nbytes: usize,
    /// `None` on a host channel.
    gpu: Option<DeviceView>,
}

impl Frame {
    fn new(f: OwnedFrame) -> Frame {
        let fr = f.frame();
        // The GPU accessors (`buffer`, `stream`) panic on a host channel: only asked of GPU frames.
        let (nbytes, gpu) = if fr.is_host() {
            (fr.len(), None)
        } else {
            let view = DeviceView {
                ptr: fr.buffer().device_ptr(),
                stream: fr.stream().as_raw() as usize,
                device: fr.buffer().context().device().ordinal() as i32,
            };
            (fr.buffer().len(), Some(view))
        };
        Frame {
            seq: fr.seq(),
            index: fr.index(),
            metadata: fr.metadata().to_vec(),
            nbytes,
            gpu,
            inner: Mutex::new(Some(Arc::new(f))),
        }
    }

    /// The device buffer, or `NotSupported` on a host channel.
    fn gpu(&self) -> PyResult<DeviceView> {
        self.gpu.ok_or_else(|| errors::not_supported(HOST_FRAME))
    }

    /// The frame's hold, or `InvalidArgument` once released.
    fn hold(&self, py: Python<'_>) -> PyResult<Arc<OwnedFrame>> {
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
    /// Device address of the buffer in this process; `NotSupported` on a host channel.
    #[getter]
    fn ptr(&self) -> PyResult<u64> {
        Ok(self.gpu()?.ptr)
    }
    /// Size of the buffer in bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.nbytes
    }
    /// The consumer's stream (a raw `CUstream`) on which the frame is ready; `NotSupported` on a
    /// host channel.
    #[getter]
    fn stream(&self) -> PyResult<usize> {
        Ok(self.gpu()?.stream)
    }
    /// Whether the buffer is shared host memory (`memory="host"`).
    #[getter]
    fn is_host(&self) -> bool {
        self.gpu.is_none()
    }

    /// A copy of `n` bytes of the host buffer from byte `offset` (`n=None`: to the end), taken
    /// while the frame is held. `InvalidArgument` past the buffer's end or once released;
    /// `NotSupported` on a GPU channel.
    #[pyo3(signature = (offset=0, n=None))]
    fn read<'py>(
        &self,
        py: Python<'py>,
        offset: usize,
        n: Option<usize>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        if self.gpu.is_some() {
            return Err(errors::not_supported(GPU_FRAME));
        }
        let n = range_arg(py, offset, n, self.nbytes)?;
        // This clone keeps the frame held through the copy, whatever another thread releases.
        let hold = self.hold(py)?;
        PyBytes::new_with(py, n, |buf| {
            copy(py, n, || hold.frame().read_at(offset, buf)).map_err(|e| err(py, e))
        })
    }

    /// A copy of the whole host buffer (`read()`); `bytes(frame)` is the same.
    fn bytes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        self.read(py, 0, None)
    }

    fn __bytes__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        self.read(py, 0, None)
    }
    /// True until `release()`.
    #[getter]
    fn held(&self) -> bool {
        lock(&self.inner).is_some()
    }

    /// Ends this object's hold (the frame is released once no DLPack tensor of it is left).
    fn release(&self, py: Python<'_>) {
        let f = lock(&self.inner).take();
        py.detach(|| drop(f));
    }

    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let gpu = self.gpu()?;
        self.hold(py)?;
        dlpack::cuda_array_interface(py, gpu.ptr, self.nbytes, false, gpu.stream)
    }

    fn __dlpack_device__(&self) -> PyResult<(i32, i32)> {
        Ok((dlpack::KDL_CUDA, self.gpu()?.device))
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
        let gpu = self.gpu()?;
        let hold = self.hold(py)?;
        let ctx = hold.consumer().context().clone();
        let ex = dlpack::Export {
            hold: dlpack::Hold::Frame(hold),
            ptr: gpu.ptr,
            nbytes: self.nbytes,
            device: gpu.device,
            ready_on: gpu.stream,
            ctx: Some(ctx),
        };
        ex.export(py, stream, max_version, dl_device, copy)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) {
        self.release(py)
    }

    fn __repr__(&self) -> String {
        format!(
            "Frame(seq={}, index={}, nbytes={}, metadata={} bytes{})",
            self.seq,
            self.index,
            self.nbytes,
            self.metadata.len(),
            if self.gpu.is_none() { ", host" } else { "" }
        )
    }
}

/// Zero-copy GPU frames between processes: the cuda-ipc channel.
#[pymodule]
#[pyo3(name = "cuda_ipc")]
fn cuda_ipc_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    m.add_class::<Producer>()?;
    m.add_class::<WriteFrame>()?;
    m.add_class::<Consumer>()?;
    m.add_class::<Frame>()?;
    m.add("META_BYTES", cuda_ipc::channel::META_BYTES)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
