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
//! and for `close()` between slices, so Ctrl-C raises `KeyboardInterrupt` promptly with nothing
//! held, and `close()` from another thread wakes them within a slice ([`sliced`]). Every duration
//! argument goes through [`seconds_arg`] (0 to [`MAX_SECONDS`], else `InvalidArgument`).

mod cleanup;
mod dlpack;
mod errors;

use cuda_ipc::channel::owned::{OwnedFrame, OwnedWriteFrame};
use cuda_ipc::channel::{
    ChannelOptions, ChannelStats, ConsumerOptions, Delivery, MemoryKind, WaitStrategy,
};
use cuda_ipc::driver::{Device, DeviceMemory};
use cuda_ipc::quota::{QuotaLedger, QuotaScope};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyMemoryView};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The longest a blocking call waits without the GIL before it checks for signals.
const SLICE: Duration = Duration::from_millis(50);

/// The longest `Producer.close()` waits for an `acquire` blocked in another thread to give the
/// producer back; it does so within one [`SLICE`] (plus the time to take the GIL).
const CLOSE_WAITS_FOR_ACQUIRE: Duration = Duration::from_secs(5);

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

/// The most seconds a duration argument (`timeout`, `spin`) may name: about 31.7 years. Longer
/// is a mistake, or means "forever", which `timeout=None` says; `Instant` arithmetic on such
/// durations would overflow.
const MAX_SECONDS: f64 = 1e9;

/// A duration argument as Python passed it, before [`seconds_arg`] checks its range: a float (or
/// an int that fits one), or an int too large for a float (kept apart so that it is an
/// `InvalidArgument` too, not the `OverflowError` of the conversion).
#[derive(Clone, Copy, Debug)]
enum Seconds {
    Float(f64),
    HugeInt,
}

impl<'a, 'py> FromPyObject<'a, 'py> for Seconds {
    type Error = PyErr;

    fn extract(obj: pyo3::Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        match obj.extract::<f64>() {
            Ok(v) => Ok(Seconds::Float(v)),
            Err(_) if obj.is_instance_of::<pyo3::types::PyInt>() => Ok(Seconds::HugeInt),
            // Not a number: the `TypeError` of the conversion.
            Err(e) => Err(e),
        }
    }
}

/// Duration argument `name` in seconds as a `Duration`: a number from 0 to [`MAX_SECONDS`].
/// Negative, NaN, infinite or larger values raise `InvalidArgument` naming `name` and the range
/// (`Duration::from_secs_f64` would panic on them); `forever` adds that `None` waits forever to
/// the message. The one check of every such argument.
fn seconds_arg(py: Python<'_>, name: &str, value: Seconds, forever: bool) -> PyResult<Duration> {
    let got = match value {
        // `try_from_secs_f64` refuses negative and non-finite values; `MAX_SECONDS` bounds it.
        Seconds::Float(v) if v <= MAX_SECONDS => match Duration::try_from_secs_f64(v) {
            Ok(d) => return Ok(d),
            Err(_) => format!("{v}"),
        },
        Seconds::Float(v) => format!("{v}"),
        Seconds::HugeInt => "an int too large for a float".to_string(),
    };
    let none = if forever { " (None waits forever)" } else { "" };
    Err(errors::invalid_argument(
        py,
        format!("{name} must be a number of seconds from 0 to {MAX_SECONDS:e}{none}, got {got}"),
    ))
}

/// A `timeout` argument: `None` (forever) stays `None`, a number is checked by [`seconds_arg`].
fn timeout_arg(py: Python<'_>, timeout: Option<Seconds>) -> PyResult<Option<Duration>> {
    timeout
        .map(|t| seconds_arg(py, "timeout", t, true))
        .transpose()
}

fn wait_arg(py: Python<'_>, wait: &str, spin: Seconds) -> PyResult<WaitStrategy> {
    // Checked whatever `wait` is: a bad value is a mistake even where it is not used.
    let spin = seconds_arg(py, "spin", spin, false)?;
    match wait {
        "block" => Ok(WaitStrategy::Block),
        "spin" => Ok(WaitStrategy::Spin),
        "spin_then_block" => Ok(WaitStrategy::SpinThenBlock(spin)),
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

/// Why one step of a [`sliced`] wait stopped without a value.
enum Stop {
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
fn sliced<T: Send>(
    py: Python<'_>,
    timeout: Option<Duration>,
    closed: impl Fn() -> bool + Sync,
    closed_error: impl FnOnce(Python<'_>) -> PyErr,
    mut step: impl FnMut(Duration) -> Result<Option<T>, Stop> + Send,
) -> PyResult<Option<T>> {
    // `checked_add`: `timeout` is at most `MAX_SECONDS`, but the deadline is no bound either way
    // when it overflows.
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

fn timeout_error(py: Python<'_>, what: &'static str, after: Option<Duration>) -> PyErr {
    err(
        py,
        cuda_ipc::Error::Timeout {
            what,
            after: after.unwrap_or_default(),
        },
    )
}

/// A stream argument as a raw `CUstream`: `None`; an `int`; an object with `cuda_stream`
/// (`torch.cuda.Stream`) or `ptr` (`cupy.cuda.Stream`), or with `__cuda_stream__` (the CUDA
/// stream protocol: a `(version, handle)` pair).
fn stream_arg(py: Python<'_>, stream: Option<&Bound<'_, PyAny>>) -> PyResult<Option<usize>> {
    let Some(s) = stream else {
        return Ok(None);
    };
    if s.is_none() {
        return Ok(None);
    }
    let raw = if let Ok(v) = s.extract::<usize>() {
        v
    } else if let Ok(p) = s.call_method0("__cuda_stream__") {
        p.extract::<(i64, usize)>()?.1
    } else if let Ok(v) = s.getattr("cuda_stream") {
        v.extract::<usize>()?
    } else if let Ok(v) = s.getattr("ptr") {
        v.extract::<usize>()?
    } else {
        return Err(errors::invalid_argument(
            py,
            format!(
                "stream must be None, an int (a CUstream), a torch.cuda.Stream or a \
                 cupy.cuda.Stream, got {}",
                s.get_type().name()?
            ),
        ));
    };
    Ok(Some(raw))
}

/// The element count of `shape` (an int or a sequence of ints), or `InvalidArgument`.
fn elements(py: Python<'_>, shape: &Bound<'_, PyAny>) -> PyResult<usize> {
    let dims: Vec<usize> = match shape.extract::<usize>() {
        Ok(n) => vec![n],
        Err(_) => shape.extract().map_err(|_| {
            errors::invalid_argument(
                py,
                "shape must be an int or a sequence of non-negative ints".to_string(),
            )
        })?,
    };
    dims.iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| errors::invalid_argument(py, "shape overflows".to_string()))
}

/// `tensor` (a one-dimensional `uint8` tensor of `nbytes` bytes: PyTorch or CuPy) viewed as
/// `dtype` and reshaped to `shape`, using the first `prod(shape) * itemsize` bytes. `itemsize`
/// reads a dtype's element size in that library.
fn shaped<'py>(
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
        Some(s) => elements(py, s)?
            .checked_mul(size)
            .ok_or_else(|| errors::invalid_argument(py, "shape overflows".to_string()))?,
        None => nbytes - nbytes % size.max(1),
    };
    if need > nbytes {
        return Err(errors::invalid_argument(
            py,
            format!("that shape and dtype need {need} bytes; the buffer has {nbytes}"),
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
fn torch_tensor<'py>(
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
fn cupy_array<'py>(
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

type RustProducer = cuda_ipc::channel::Producer;

/// The producing end of a channel (`cuda_ipc::channel::Producer`).
///
/// The Rust producer is lent, by value, to a blocking `acquire` and then to the `WriteFrame` it
/// returns, and comes back when they end; it is closed (and dropped) by whoever holds it once
/// `close()` was called, so it is never dropped while in use: see [`Producer::give_back`].
#[pyclass(module = "cuda_ipc", frozen)]
struct Producer {
    state: Mutex<ProducerState>,
    /// Notified whenever the Rust producer comes back to `state`: a `close()` waiting for an
    /// `acquire` of another thread (`ProducerState::close_waits`) waits on it.
    back: Condvar,
    name: String,
    memory: MemoryKind,
    /// The `stream=` option: every write frame's publish is ordered after it.
    stream: Option<usize>,
}

/// What [`Producer::state`] guards, in one lock so that a close and a hand-back are ordered.
struct ProducerState {
    /// `None` while an `acquire` or a `WriteFrame` has it, and after `close()`.
    producer: Option<Box<RustProducer>>,
    /// `close()` was called: blocking calls stop, the producer is closed when it comes back.
    closed: bool,
    /// The thread of the `acquire` that has the producer, while one does.
    acquiring: Option<std::thread::ThreadId>,
    /// A `close()` waits (`back`) for that `acquire` to give the producer back; it closes it.
    close_waits: bool,
    /// The `timeout` of `close()`, for a producer that comes back after it.
    close_timeout: Duration,
}

impl Producer {
    /// Lends the Rust producer out (to an `acquire` of this thread when `acquiring`).
    fn take(&self, py: Python<'_>, acquiring: bool) -> PyResult<Box<RustProducer>> {
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

    /// `ChannelClosed`: what every call raises once `close()` was called.
    fn closed_error(&self) -> PyErr {
        errors::ChannelClosed::new_err(format!("the producer of channel {:?} is closed", self.name))
    }

    fn is_closed(&self) -> bool {
        lock(&self.state).closed
    }

    /// Takes the Rust producer back from an `acquire` (`from_acquire`) or a `WriteFrame`. Once
    /// `close()` was called, it is closed here, with the GIL released, unless that `close()`
    /// waits for it (a `close()` from another thread than a blocked `acquire`'s): it closes it.
    /// So the channel is closed exactly once, by the one who holds the producer.
    fn give_back(&self, py: Python<'_>, p: Box<RustProducer>, from_acquire: bool) {
        let mut s = lock(&self.state);
        if from_acquire {
            s.acquiring = None;
        }
        if s.closed && !s.close_waits {
            let t = s.close_timeout;
            drop(s);
            // Nobody is left to tell of a failure: as the Rust producer's `Drop`, which logs it.
            py.detach(|| drop(p.close(t)));
            return;
        }
        s.producer = Some(p);
        drop(s);
        self.back.notify_all();
    }

    /// The write frame an `acquire` got, unless `close()` came meanwhile: then it goes back
    /// unpublished (the producer closed) and `ChannelClosed` is raised. Decided under the lock,
    /// so a `close()` either came first (and is seen here) or sees the loan to the `WriteFrame`
    /// (and leaves the closing to its publish or abandon).
    fn hand_out(&self, slf: &Bound<'_, Self>, f: OwnedWriteFrame) -> PyResult<WriteFrame> {
        let py = slf.py();
        let mut s = lock(&self.state);
        if s.closed {
            drop(s);
            self.give_back(py, f.into_producer(), true);
            return Err(self.closed_error());
        }
        s.acquiring = None;
        drop(s);
        WriteFrame::new(py, slf.clone().unbind(), f)
    }
}

#[pymethods]
impl Producer {
    /// Creates channel `name` with a pool of `buffers` buffers of `buffer_bytes` bytes on CUDA
    /// device `device` (its primary context); with `memory="host"`, of shared host memory
    /// (`Producer::create_host`: no CUDA driver needed, `device` unused).
    #[new]
    #[pyo3(signature = (name, buffer_bytes, *, buffers=4, max_consumers=8, quota_bytes=None,
        quota=None, wait="spin_then_block", spin=Seconds::Float(50e-6), memory="auto",
        group_access=false, device=0, stream=None))]
    #[pyo3(
        text_signature = "(name, buffer_bytes, *, buffers=4, max_consumers=8, \
        quota_bytes=None, quota=None, wait=\"spin_then_block\", spin=5e-05, memory=\"auto\", \
        group_access=False, device=0, stream=None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        name: String,
        buffer_bytes: usize,
        buffers: usize,
        max_consumers: usize,
        quota_bytes: Option<u64>,
        quota: Option<&str>,
        wait: &str,
        spin: Seconds,
        memory: &str,
        group_access: bool,
        device: usize,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let stream = stream_arg(py, stream)?;
        if stream.is_some() && memory == "host" {
            return Err(errors::invalid_argument(
                py,
                "a host-memory channel has no streams to order: leave stream=None".to_string(),
            ));
        }
        let mut opts = ChannelOptions::new(buffer_bytes)
            .buffers(buffers)
            .max_consumers(max_consumers)
            .wait(wait_arg(py, wait, spin)?)
            .memory(memory_arg(py, memory)?)
            .group_access(group_access);
        if let Some(q) = quota_bytes {
            opts = opts.quota_bytes(q);
        }
        if let Some(q) = quota {
            opts = opts.quota(quota_scope(q).map_err(|e| err(py, e))?);
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
    /// `ChannelClosed` once `close()` was called, also from another thread while this waits (it
    /// wakes within 50 ms); `Timeout`; `InvalidArgument` while a `WriteFrame` is outstanding.
    #[pyo3(signature = (timeout=None))]
    fn acquire(slf: &Bound<'_, Self>, timeout: Option<Seconds>) -> PyResult<WriteFrame> {
        let py = slf.py();
        let timeout = timeout_arg(py, timeout)?;
        let this = slf.get();
        let mut producer = Some(this.take(py, true)?);
        let got = sliced(
            py,
            timeout,
            || this.is_closed(),
            |_| this.closed_error(),
            |slice| {
                let Some(p) = producer.take() else {
                    // Never: the producer is put back after every slice that does not end the
                    // wait. Stopping is the safe answer should that change.
                    return Err(Stop::Closed);
                };
                match OwnedWriteFrame::acquire(p, Some(slice)) {
                    Ok(f) => Ok(Some(f)),
                    Err((p, cuda_ipc::Error::Timeout { .. })) => {
                        producer = Some(p);
                        Ok(None)
                    }
                    Err((p, e)) => {
                        producer = Some(p);
                        Err(e.into())
                    }
                }
            },
        );
        if let Some(p) = producer.take() {
            this.give_back(py, p, true);
        }
        match got? {
            Some(f) => this.hand_out(slf, f),
            None => Err(timeout_error(py, "a free buffer", timeout)),
        }
    }

    /// A free buffer if one is free now, else `None`. `ChannelClosed` once closed.
    fn try_acquire(slf: &Bound<'_, Self>) -> PyResult<Option<WriteFrame>> {
        let py = slf.py();
        let this = slf.get();
        let p = this.take(py, true)?;
        match OwnedWriteFrame::acquire(p, Some(Duration::ZERO)) {
            Ok(f) => this.hand_out(slf, f).map(Some),
            Err((p, cuda_ipc::Error::Timeout { .. })) => {
                this.give_back(py, p, true);
                Ok(None)
            }
            Err((p, e)) => {
                this.give_back(py, p, true);
                Err(err(py, e))
            }
        }
    }

    /// The channel's counters as a dict. `ChannelClosed` once closed; `InvalidArgument` while a
    /// `WriteFrame` is outstanding.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = {
            let st = lock(&self.state);
            match &st.producer {
                Some(p) => p.stats(),
                None if st.closed => return Err(self.closed_error()),
                None => {
                    return Err(errors::invalid_argument(
                        py,
                        "a WriteFrame of this producer is outstanding: publish or abandon it first"
                            .to_string(),
                    ));
                }
            }
        };
        stats_dict(py, &s)
    }

    /// Closes the channel: waits up to `timeout` seconds (0 to 1e9) for consumers' holds, then
    /// frees the pool. Returns `{"forced_holds": n}`. Closing again does nothing.
    ///
    /// A thread blocked in `acquire()` raises `ChannelClosed` within 50 ms, and this waits for it
    /// to give the producer back (a close from within that `acquire`, by a signal handler, does
    /// not wait: that `acquire` closes the channel as it ends). While a `WriteFrame` is
    /// outstanding, the channel is closed when it is published (which then raises
    /// `ChannelClosed`) or abandoned, and this returns `{"forced_holds": 0}` at once.
    #[pyo3(signature = (timeout=Seconds::Float(5.0)))]
    #[pyo3(text_signature = "($self, timeout=5.0)")]
    fn close<'py>(&self, py: Python<'py>, timeout: Seconds) -> PyResult<Bound<'py, PyDict>> {
        let t = seconds_arg(py, "timeout", timeout, false)?;
        let me = std::thread::current().id();
        let p = py.detach(|| {
            let mut s = lock(&self.state);
            if !s.closed {
                s.closed = true;
                s.close_timeout = t;
            }
            if s.producer.is_none() && s.acquiring.is_some_and(|a| a != me) {
                // The blocked `acquire` sees `closed` before its next slice and gives the
                // producer back (`give_back`, which sees `close_waits` and leaves it here). It
                // needs neither this lock (released while waiting) nor the GIL (released above).
                // Bounded all the same (`CLOSE_WAITS_FOR_ACQUIRE`): should that `acquire` not come
                // back (a bug), this returns and whoever gives the producer back closes it.
                s.close_waits = true;
                s = self
                    .back
                    .wait_timeout_while(s, CLOSE_WAITS_FOR_ACQUIRE, |s| {
                        s.producer.is_none() && s.acquiring.is_some()
                    })
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
                s.close_waits = false;
            }
            s.producer.take()
        });
        let d = PyDict::new(py);
        let forced = match p {
            Some(p) => {
                py.detach(|| p.close(t))
                    .map_err(|e| err(py, e))?
                    .forced_holds
            }
            None => 0,
        };
        d.set_item("forced_holds", forced)?;
        Ok(d)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<()> {
        self.close(py, Seconds::Float(5.0)).map(|_| ())
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
    /// Raw streams the publish is ordered after (`publish_after`, `__dlpack__(stream=)`, the
    /// producer's `stream=`).
    after: Mutex<Vec<usize>>,
    producer: Py<Producer>,
    index: usize,
    nbytes: usize,
    /// `None` on a host channel.
    gpu: Option<DeviceView>,
}

impl WriteFrame {
    fn new(py: Python<'_>, producer: Py<Producer>, f: OwnedWriteFrame) -> PyResult<WriteFrame> {
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
        let other = producer.get().stream;
        let w = WriteFrame {
            inner: Mutex::new(Some(f)),
            after: Mutex::new(Vec::new()),
            producer,
            index,
            nbytes,
            gpu,
        };
        if let Some(s) = other {
            // The producer's `stream=`: writes go there, so it waits first for the buffer's last
            // readers, and the publish after it. (On an error the frame drops: the buffer goes
            // back.)
            w.order_after(py, s)?;
        }
        Ok(w)
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

    /// Notes that the publish must come after work on raw stream `s`, and makes `s` wait for the
    /// buffer's last readers the first time (`WriteFrame::ready_on`): writes on `s` follow.
    fn order_after(&self, py: Python<'_>, s: usize) -> PyResult<()> {
        let mut after = lock(&self.after);
        if self.gpu.is_some_and(|g| g.stream != s) && !after.contains(&s) {
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
        if let Some(f) = lock(&self.inner).take() {
            // Collected unpublished: the buffer goes back, the producer to its Python object.
            let p = f.into_producer();
            Python::attach(|py| self.producer.get().give_back(py, p, false));
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

    /// Orders the publish after the work enqueued on `stream` (an int `CUstream`, a
    /// `torch.cuda.Stream`, a `cupy.cuda.Stream`) by the time `publish` is called: write the
    /// buffer there, then publish. `__dlpack__(stream=s)` (what `torch.from_dlpack` and
    /// `as_tensor` do) notes `s` the same way. `NotSupported` on a host channel.
    fn publish_after(&self, py: Python<'_>, stream: &Bound<'_, PyAny>) -> PyResult<()> {
        self.gpu()?;
        if lock(&self.inner).is_none() {
            return Err(Self::done(py));
        }
        if let Some(s) = stream_arg(py, Some(stream))? {
            self.order_after(py, s)?;
        }
        Ok(())
    }

    /// Publishes the frame with `metadata` (at most 256 bytes); returns its sequence number.
    /// On a GPU channel the consumers' streams wait for the work enqueued so far on the
    /// producer's stream and on every stream noted by `publish_after` or `__dlpack__(stream=)`.
    /// `ChannelClosed` once the producer was closed: the frame goes back unpublished.
    #[pyo3(signature = (metadata=b"".as_slice()))]
    fn publish(&self, py: Python<'_>, metadata: &[u8]) -> PyResult<u64> {
        let producer = self.producer.get();
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
    fn abandon(&self, py: Python<'_>) {
        if let Some(f) = self.finish(py) {
            self.producer.get().give_back(py, f.into_producer(), false);
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
    /// buffer has; `NotSupported` on a host channel; `ImportError` without PyTorch.
    #[pyo3(signature = (shape=None, dtype=None))]
    fn as_tensor<'py>(
        slf: &Bound<'py, Self>,
        shape: Option<&Bound<'py, PyAny>>,
        dtype: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        slf.get().gpu()?;
        torch_tensor(slf.as_any(), slf.get().nbytes, shape, dtype)
    }

    /// The buffer as a CuPy array, as `as_tensor` (CuPy's current stream; `dtype` anything
    /// `cupy.dtype` takes).
    #[pyo3(signature = (shape=None, dtype=None))]
    fn as_cupy<'py>(
        slf: &Bound<'py, Self>,
        shape: Option<&Bound<'py, PyAny>>,
        dtype: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        slf.get().gpu()?;
        cupy_array(slf.as_any(), slf.get().nbytes, shape, dtype)
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
    /// The `stream=` option: every frame is made ready on it and released after it.
    stream: Option<usize>,
}

impl Consumer {
    /// The Rust consumer, shared with the caller (it lives until the last user lets go), or
    /// `Detached` once closed.
    fn get(&self, py: Python<'_>) -> PyResult<Arc<cuda_ipc::channel::Consumer>> {
        lock(&self.inner).clone().ok_or_else(|| detached(py))
    }

    fn is_closed(&self) -> bool {
        lock(&self.inner).is_none()
    }

    /// `f`, taken by a receive, unless `close()` came meanwhile: then `f` is released (this closed
    /// consumer's frame, which nobody else was to get) and the receive raises `Detached`. Decided
    /// under the lock `close()` takes the consumer under, so each receive is ordered against the
    /// close: a frame is returned only by a receive that took it before the close.
    fn hand_out(&self, f: OwnedFrame) -> Result<OwnedFrame, Stop> {
        let open = lock(&self.inner).is_some();
        if open {
            Ok(f)
        } else {
            drop(f);
            Err(Stop::Closed)
        }
    }
}

/// `Detached`: what a consumer's calls raise once it was closed.
fn detached(py: Python<'_>) -> PyErr {
    err(py, cuda_ipc::channel::ChannelError::Detached.into())
}

#[pymethods]
impl Consumer {
    /// Attaches to channel `name` on the device that holds its pool; receives frames published
    /// from now on.
    #[new]
    #[pyo3(signature = (name, *, delivery="every", wait="spin_then_block",
        spin=Seconds::Float(50e-6), group_access=false, stream=None))]
    #[pyo3(
        text_signature = "(name, *, delivery=\"every\", wait=\"spin_then_block\", \
        spin=5e-05, group_access=False, stream=None)"
    )]
    fn new(
        py: Python<'_>,
        name: String,
        delivery: &str,
        wait: &str,
        spin: Seconds,
        group_access: bool,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let stream = stream_arg(py, stream)?;
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
        if stream.is_some() && c.is_host() {
            return Err(errors::invalid_argument(
                py,
                "a host-memory channel has no streams to order: leave stream=None".to_string(),
            ));
        }
        Ok(Consumer {
            inner: Mutex::new(Some(Arc::new(c))),
            name,
            stream,
        })
    }

    /// The same as `Consumer(name, ...)`.
    #[classmethod]
    #[pyo3(signature = (name, *, delivery="every", wait="spin_then_block",
        spin=Seconds::Float(50e-6), group_access=false, stream=None))]
    #[pyo3(
        text_signature = "(name, *, delivery=\"every\", wait=\"spin_then_block\", \
        spin=5e-05, group_access=False, stream=None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn attach(
        _cls: &Bound<'_, pyo3::types::PyType>,
        py: Python<'_>,
        name: String,
        delivery: &str,
        wait: &str,
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
        let c = self.get(py)?;
        let got = sliced(
            py,
            timeout,
            || self.is_closed(),
            detached,
            |slice| match OwnedFrame::recv(&c, Some(slice))? {
                Some(f) => self.hand_out(f).map(Some),
                None => Ok(None),
            },
        )?;
        match got {
            Some(f) => Frame::new(py, f, self.stream),
            None => Err(timeout_error(py, "a frame", timeout)),
        }
    }

    /// The next frame if one is ready now, else `None`. `Detached` once closed.
    fn try_recv(&self, py: Python<'_>) -> PyResult<Option<Frame>> {
        let c = self.get(py)?;
        let got = py.detach(|| match OwnedFrame::try_recv(&c)? {
            Some(f) => self.hand_out(f).map(Some),
            None => Ok(None),
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
        Ok(c.stream().as_raw() as usize)
    }

    /// Whether the channel's pool is shared host memory (made with `memory="host"`).
    #[getter]
    fn is_host(&self, py: Python<'_>) -> PyResult<bool> {
        Ok(self.get(py)?.is_host())
    }

    /// Detaches. Frames (and their DLPack tensors) still alive keep the slot until they go. A
    /// thread blocked in `recv()` (or iterating) raises `Detached` within 50 ms; the slot is
    /// given back once it has. Never waits for that thread.
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
    /// Raw streams the release is ordered after (`ready_on`, the consumer's `stream=`).
    after: Mutex<Vec<usize>>,
    seq: u64,
    index: usize,
    metadata: Vec<u8>,
    nbytes: usize,
    /// `None` on a host channel.
    gpu: Option<DeviceView>,
}

impl Frame {
    /// Wraps `f`; with `stream`, makes it ready there (`ready_on`), or releases it and raises.
    fn new(py: Python<'_>, f: OwnedFrame, stream: Option<usize>) -> PyResult<Frame> {
        let frame = Self::wrap(f);
        if let Some(s) = stream {
            frame.ready_on_raw(py, s)?;
        }
        Ok(frame)
    }

    fn wrap(f: OwnedFrame) -> Frame {
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
            after: Mutex::new(Vec::new()),
        }
    }

    /// `ready_on` for raw stream `s`: on failure the frame is released and the error raised.
    fn ready_on_raw(&self, py: Python<'_>, s: usize) -> PyResult<()> {
        let gpu = self.gpu()?;
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

    /// Ends this object's hold (the frame is released once no DLPack tensor of it is left),
    /// ordered after the work enqueued by now on every stream named by `ready_on` or the
    /// consumer's `stream=`. A second call does nothing.
    fn release(&self, py: Python<'_>) -> PyResult<()> {
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
        let ctx = failed.as_ref().map(|_| f.consumer().context().clone());
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
    /// of `release()`. `stream` must stay valid until then. `NotSupported` on a host channel;
    /// `InvalidArgument` once released; on a CUDA error the frame is released and the error raised.
    fn ready_on(&self, py: Python<'_>, stream: &Bound<'_, PyAny>) -> PyResult<()> {
        self.gpu()?;
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
    /// channel; `ImportError` without PyTorch.
    #[pyo3(signature = (shape=None, dtype=None))]
    fn as_tensor<'py>(
        slf: &Bound<'py, Self>,
        shape: Option<&Bound<'py, PyAny>>,
        dtype: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        slf.get().gpu()?;
        torch_tensor(slf.as_any(), slf.get().nbytes, shape, dtype)
    }

    /// The buffer as a CuPy array, as `as_tensor` (CuPy's current stream; `dtype` anything
    /// `cupy.dtype` takes).
    #[pyo3(signature = (shape=None, dtype=None))]
    fn as_cupy<'py>(
        slf: &Bound<'py, Self>,
        shape: Option<&Bound<'py, PyAny>>,
        dtype: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        slf.get().gpu()?;
        cupy_array(slf.as_any(), slf.get().nbytes, shape, dtype)
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
        let ex = dlpack::Export {
            hold: dlpack::Hold::Frame(dlpack::FrameHold {
                frame: hold.clone(),
                release_after: None,
            }),
            ptr: gpu.ptr,
            nbytes: self.nbytes,
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
            "Frame(seq={}, index={}, nbytes={}, metadata={} bytes{})",
            self.seq,
            self.index,
            self.nbytes,
            self.metadata.len(),
            if self.gpu.is_none() { ", host" } else { "" }
        )
    }
}

/// The quota scope a `quota=` or `scope=` string names: `"user"` (this process's effective uid)
/// or `"group:NAME"` (a group name or numeric gid this process belongs to).
fn quota_scope(s: &str) -> cuda_ipc::Result<QuotaScope> {
    match s.split_once(':') {
        None if s == "user" => Ok(QuotaScope::user()),
        Some(("group", g)) if !g.is_empty() => QuotaScope::group(g),
        _ => Err(cuda_ipc::Error::InvalidArgument(format!(
            "quota scope {s:?}: \"user\" or \"group:NAME\""
        ))),
    }
}

/// The device UUID of a budget: host memory (`device=None`, the all-zero UUID) or CUDA device
/// `device`'s.
fn quota_device(device: Option<usize>) -> cuda_ipc::Result<cuda_ipc::driver::Uuid> {
    match device {
        None => Ok(cuda_ipc::driver::Uuid([0; 16])),
        Some(d) => Ok(Device::get(d)?.uuid()),
    }
}

/// Sets the shared budget, in bytes, that producers created with `quota=scope` reserve their pools
/// from: for host-memory channels (`device=None`) or for CUDA device `device`. Creates the ledger
/// (mode 0600 for `"user"`, 0660 for `"group:NAME"`) or changes its budget; reservations already
/// made stay. The same as `cuda-ipc quota set`.
///
/// Raises `QuotaError` when the ledger is another user's, `InvalidArgument` for a bad scope or a
/// group this process is not in, `BadSegment` for something else under the ledger's name.
#[pyfunction]
#[pyo3(signature = (budget_bytes, *, scope="user", device=None))]
fn set_quota(
    py: Python<'_>,
    budget_bytes: u64,
    scope: &str,
    device: Option<usize>,
) -> PyResult<()> {
    let scope = quota_scope(scope).map_err(|e| err(py, e))?;
    py.detach(|| QuotaLedger::set_budget(scope, quota_device(device)?, budget_bytes).map(|_| ()))
        .map_err(|e| err(py, e))
}

/// Removes the budget of `scope` for host memory (`device=None`) or CUDA device `device`; returns
/// whether there was one. Producers holding reservations keep them. The same as `cuda-ipc quota
/// remove`.
///
/// Raises `QuotaError` when the ledger is another user's.
#[pyfunction]
#[pyo3(signature = (*, scope="user", device=None))]
fn remove_quota(py: Python<'_>, scope: &str, device: Option<usize>) -> PyResult<bool> {
    let scope = quota_scope(scope).map_err(|e| err(py, e))?;
    py.detach(|| match QuotaLedger::open(scope, quota_device(device)?) {
        Ok(l) => l.remove(),
        Err(cuda_ipc::Error::Shm(cuda_ipc::ShmError::NotFound { .. })) => Ok(false),
        Err(e) => Err(e),
    })
    .map_err(|e| err(py, e))
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
    m.add_function(wrap_pyfunction!(set_quota, m)?)?;
    m.add_function(wrap_pyfunction!(remove_quota, m)?)?;
    m.add_function(wrap_pyfunction!(cleanup::cleanup, m)?)?;
    m.add("META_BYTES", cuda_ipc::channel::META_BYTES)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
