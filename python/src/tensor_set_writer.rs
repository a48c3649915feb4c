//! The `TensorSetWriter` and `TensorUpdate` classes (`cuda_ipc::tensorset::TensorSetWriter`,
//! `Update`).
//!
//! Streams: an update is written on PyTorch's current stream of the set's device (or the
//! `stream=` given to `begin`): `begin` makes that stream wait on the GPU for the writer's stream,
//! which waits for the readers' release words, and the commit makes the writer's stream wait for
//! that stream before it writes the generation's ready word. The host never waits for the GPU.

use crate::copy_plan::{self, CopyPlan};
use crate::errors;
use crate::sources::{self, coalesce, copy_gpu};
use crate::tensors::{self, specs_arg};
use crate::util::{
    CLOSE_WAITS_FOR_ACQUIRE, Int, Seconds, Stop, device_arg, err, lock, memory_arg, sliced,
    stream_arg, timeout_arg,
};
use cuda_ipc::Error;
use cuda_ipc::channel::MemoryKind;
use cuda_ipc::driver::{Context, Device};
use cuda_ipc::tensorset::owned::OwnedUpdate;
use cuda_ipc::tensorset::{GenerationMode, Layout, TensorSetOptions, TensorSpec};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

type RustWriter = cuda_ipc::tensorset::TensorSetWriter;

/// What a writer holds between updates: the Rust writer, or nothing while an update owns it.
enum Slot {
    Idle(Box<RustWriter>),
    Updating,
    Closed,
}

/// The writer's [`Slot`] and how a `close()` meets the call that has the Rust writer: in one lock,
/// so that a close and a `begin`'s hand-out of its update are ordered (the close either came
/// first, and the `begin` raises `TensorSetClosed`, or it finds the update and aborts it).
struct State {
    slot: Slot,
    /// The thread of the `begin` that has the writer while it waits for a buffer.
    beginning: Option<std::thread::ThreadId>,
    /// `close()` was called (with this `timeout`) while another call had the writer: a `begin`
    /// stops before its next slice; the writer is closed when it comes back (`give_back`).
    closing: Option<Duration>,
    /// A `close()` waits (`back`) for that `begin` to give the writer back, and closes it.
    close_waits: bool,
}

/// The writing end of a tensor set (`cuda_ipc::tensorset::TensorSetWriter`).
#[pyclass(module = "cuda_ipc", frozen)]
pub(crate) struct TensorSetWriter {
    state: Mutex<State>,
    /// Notified whenever the Rust writer comes back to `state`: a `close()` waiting for a `begin`
    /// of another thread (`State::close_waits`) waits on it.
    back: Condvar,
    name: String,
    pub(crate) layout: Arc<Layout>,
    pub(crate) device: i32,
    pub(crate) host: bool,
    /// The last generation committed.
    generation: Mutex<u64>,
    /// For `over_tensors`: the published tensors, kept alive while the set is (their memory must
    /// not go back to PyTorch's pool while readers map it).
    _keep: Option<Py<PyDict>>,
    /// The open update's cell (shared with its `TensorUpdate`), so `close()` can abort it.
    open: Mutex<Weak<Mutex<Option<OwnedUpdate>>>>,
    /// The tensors' names as `str`s and the name → index dict over them, made at first use.
    names: PyOnceLock<Py<PyTuple>>,
    index: PyOnceLock<Py<PyDict>>,
    /// Each buffer's dict of writable tensors, built at its first `TensorUpdate.tensors()`;
    /// dropped at `close()`.
    dicts: Mutex<HashMap<usize, Py<PyDict>>>,
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
        let torch = py.import("torch")?;
        let s = torch
            .getattr("cuda")?
            .call_method1("current_stream", (device,))?
            .getattr("cuda_stream")?
            .extract::<usize>()?;
        return Ok(s);
    }
    Ok(1)
}

fn mode_arg(py: Python<'_>, mode: &str, buffers: usize) -> PyResult<GenerationMode> {
    match mode {
        "in_place" => Ok(GenerationMode::InPlace),
        "buffered" => Ok(GenerationMode::Buffered(buffers)),
        m => Err(errors::invalid_argument(
            py,
            format!("mode must be \"in_place\" or \"buffered\", got {m:?}"),
        )),
    }
}

fn closed_error(py: Python<'_>, name: &str) -> PyErr {
    err(
        py,
        cuda_ipc::tensorset::TensorSetError::Closed(name.to_string()).into(),
    )
}

impl TensorSetWriter {
    fn new_from(w: RustWriter, device: i32, keep: Option<Py<PyDict>>) -> TensorSetWriter {
        TensorSetWriter {
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
            dicts: Mutex::new(HashMap::new()),
        }
    }

    /// The name → index dict of the set's tensors, made at the first call.
    pub(crate) fn index<'py>(&self, py: Python<'py>) -> PyResult<&Bound<'py, PyDict>> {
        Ok(self
            .index
            .get_or_try_init(py, || sources::index_dict(py, self.name_strs(py)?))?
            .bind(py))
    }

    fn name_strs<'py>(&self, py: Python<'py>) -> PyResult<&Bound<'py, PyTuple>> {
        Ok(self
            .names
            .get_or_try_init(py, || tensors::name_strings(py, &self.layout))?
            .bind(py))
    }

    /// Takes the Rust writer out for a `begin` of this thread.
    fn take(&self, py: Python<'_>) -> PyResult<Box<RustWriter>> {
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
    fn is_closing(&self) -> bool {
        lock(&self.state).closing.is_some()
    }

    /// Takes the Rust writer back from a `begin` or an update. Once `close()` was called
    /// meanwhile, it is closed here, with the GIL released, unless that `close()` waits for it (a
    /// `close()` from another thread than a waiting `begin`'s): it closes it. So the set is
    /// closed exactly once, by the one who holds the writer.
    fn give_back(&self, py: Python<'_>, w: Box<RustWriter>) {
        *lock(&self.generation) = w.generation();
        let mut s = lock(&self.state);
        s.beginning = None;
        if let Some(t) = s.closing.filter(|_| !s.close_waits) {
            s.slot = Slot::Closed;
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

#[pymethods]
impl TensorSetWriter {
    /// Creates tensor set `name` holding `tensors` (a dict of name → `torch.Tensor`, whose shapes
    /// and dtypes are taken, or name → `(shape, dtype)`), laid out contiguous in one allocation
    /// per buffer on CUDA device `device`; nothing is published until the first commit.
    /// `quota`: reserve the set's bytes (buffers × bytes) from a shared budget (`"user"` or
    /// `"group:GID"`, as `Producer`'s), raising `OverQuota` past it.
    #[new]
    #[pyo3(signature = (name, tensors, *, device=Int::Small(0), memory="vmm", mode="in_place",
        buffers=Int::Small(2), max_readers=Int::Small(64), quota=None))]
    #[pyo3(
        text_signature = "(name, tensors, *, device=0, memory=\"vmm\", mode=\"in_place\", \
        buffers=2, max_readers=64, quota=None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        name: String,
        tensors: &Bound<'_, PyDict>,
        device: Int,
        memory: &str,
        mode: &str,
        buffers: Int,
        max_readers: Int,
        quota: Option<&str>,
    ) -> PyResult<Self> {
        let device = device_arg(py, device)?;
        let buffers: usize = buffers.get(py, "buffers")?;
        let max_readers: usize = max_readers.get(py, "max_readers")?;
        let specs = specs_arg(py, tensors)?;
        let kind = memory_arg(py, memory)?;
        let mut opts = TensorSetOptions::new()
            .memory(kind)
            .mode(mode_arg(py, mode, buffers)?)
            .max_readers(max_readers);
        if let Some(q) = quota {
            opts = opts.quota(crate::quota::quota_scope(q).map_err(|e| err(py, e))?);
        }
        let w = py
            .detach(|| -> cuda_ipc::Result<RustWriter> {
                if kind == MemoryKind::Host {
                    return RustWriter::create_host(&name, &specs, &opts);
                }
                let ctx = Device::get(device)?.primary_context()?;
                RustWriter::create(&ctx, &name, &specs, &opts)
            })
            .map_err(|e| err(py, e))?;
        Ok(Self::new_from(w, device as i32, None))
    }

    /// Publishes `tensors` (a dict of name → CUDA `torch.Tensor`, e.g. a model's `state_dict()`)
    /// as tensor set `name` without a copy: every tensor must live in memory of
    /// `cuda_ipc.torch_mem_pool` (a model built under `torch.cuda.use_mem_pool(pool)`); the set
    /// lists the arena's chunks that hold them and each tensor's place there (strides kept). In
    /// place only: update the tensors between `begin()` and the commit (a tensor that is a strided
    /// view, such as a transposed one, is updated through its own tensor, never by `copy_from`).
    /// Tensors with no elements need no memory and are accepted (readers get empty tensors of
    /// their shapes). Generation 1 is committed at once. The writer keeps the tensors alive until
    /// it closes.
    ///
    /// Raises `InvalidArgument` for a value that is not a tensor, a tensor with bytes outside the
    /// pool's memory (a CPU tensor, one of PyTorch's own allocator) or on another device, and
    /// when no tensor has bytes.
    #[staticmethod]
    #[pyo3(signature = (name, tensors, *, device=Int::Small(0), max_readers=Int::Small(64)))]
    #[pyo3(text_signature = "(name, tensors, *, device=0, max_readers=64)")]
    fn over_tensors(
        py: Python<'_>,
        name: String,
        tensors: &Bound<'_, PyDict>,
        device: Int,
        max_readers: Int,
    ) -> PyResult<Self> {
        let device = device_arg(py, device)?;
        let max_readers: usize = max_readers.get(py, "max_readers")?;
        let torch = tensors::Torch::get(py)?;
        let mut chunks: Vec<(usize, cuda_ipc::ipc::VmmBuffer)> = Vec::new();
        let mut located: Vec<(TensorSpec, u32, u64)> = Vec::with_capacity(tensors.len());
        for (k, t) in tensors.iter() {
            let name: String = k.extract()?;
            if !torch.is_tensor(py, &t) {
                return Err(errors::invalid_argument(
                    py,
                    format!(
                        "tensor {name:?}: a {} is not a torch.Tensor",
                        t.get_type().name()?
                    ),
                ));
            }
            let dtype = tensors::dtype_arg(py, &t.getattr("dtype")?)?;
            let shape: Vec<i64> = t.getattr("shape")?.extract()?;
            let strides: Vec<i64> = t.call_method0("stride")?.extract()?;
            let ptr: u64 = t.call_method0("data_ptr")?.extract()?;
            let elem = dtype.size_bytes().unwrap_or(1) as i64;
            let span = if shape.contains(&0) {
                0
            } else {
                elem * (1 + shape
                    .iter()
                    .zip(&strides)
                    .map(|(d, s)| (d - 1) * s)
                    .sum::<i64>())
            };
            if span == 0 {
                // No bytes (a dimension of extent 0): PyTorch allocated nothing for it, so it
                // lies in no arena. It is placed at the start of the first chunk once one is
                // known; readers get an empty tensor of its shape and dtype.
                located.push((
                    TensorSpec::strided(name, dtype, &shape, &strides),
                    u32::MAX,
                    0,
                ));
                continue;
            }
            let Some((dev, chunk, buf, offset)) = crate::torch_alloc::find(ptr, span as usize)
            else {
                return Err(errors::invalid_argument(
                    py,
                    format!(
                        "tensor {name:?} does not live in cuda_ipc.torch_mem_pool memory: build \
                         the model under torch.cuda.use_mem_pool(cuda_ipc.torch_mem_pool()) or \
                         publish it with a copy (TensorSetWriter(...).publish)"
                    ),
                ));
            };
            if dev != device as i32 {
                return Err(errors::invalid_argument(
                    py,
                    format!("tensor {name:?} is on device {dev}, not {device}"),
                ));
            }
            let a = match chunks.iter().position(|(c, _)| *c == chunk) {
                Some(a) => a,
                None => {
                    chunks.push((chunk, buf));
                    chunks.len() - 1
                }
            };
            located.push((
                TensorSpec::strided(name, dtype, &shape, &strides),
                a as u32,
                offset,
            ));
        }
        if chunks.is_empty() {
            return Err(errors::invalid_argument(
                py,
                "no tensor given has bytes in cuda_ipc.torch_mem_pool memory (a set over tensors \
                 needs at least one that is not empty)"
                    .to_string(),
            ));
        }
        for l in located.iter_mut().filter(|l| l.1 == u32::MAX) {
            l.1 = 0;
        }
        let allocations = chunks.into_iter().map(|(_, b)| b).collect();
        let opts = TensorSetOptions::new().max_readers(max_readers);
        let w = py
            .detach(|| -> cuda_ipc::Result<RustWriter> {
                let ctx: Arc<Context> = Device::get(device)?.primary_context()?;
                // The tensors' last writes were enqueued on PyTorch's streams: wait for them before
                // generation 1 says the memory is ready.
                ctx.synchronize()?;
                let mut w = RustWriter::create_over(&ctx, &name, &located, allocations, &opts)?;
                w.begin(Some(std::time::Duration::from_secs(5)))?.commit()?;
                Ok(w)
            })
            .map_err(|e| err(py, e))?;
        Ok(Self::new_from(
            w,
            device as i32,
            Some(tensors.copy()?.unbind()),
        ))
    }

    /// Takes the buffer of the next generation (waiting up to `timeout` seconds, `None`: forever,
    /// while readers hold it; in place, the generation stays reserved across the 50 ms slices
    /// this waits in, `TensorSetWriter::begin_slice`, and is given back when the wait ends
    /// without the buffer) and returns the update; its work runs on `stream` (default:
    /// PyTorch's current stream), which is made to wait for the buffer's last readers on the GPU.
    /// Use it as a context manager: the update commits when the block ends without an exception
    /// and is aborted otherwise. Raises `TensorSetClosed` once the writer is closed, also by
    /// `close()` from another thread while this waits (within one 50 ms slice) or while the
    /// update is open (which aborts it: its calls and the block's end raise `TensorSetClosed`).
    #[pyo3(signature = (timeout=None, *, stream=None))]
    fn begin(
        slf: Bound<'_, Self>,
        py: Python<'_>,
        timeout: Option<Seconds>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<TensorUpdate> {
        let this = slf.get();
        let timeout = timeout_arg(py, timeout)?;
        let target = if this.host {
            None
        } else {
            Some(work_stream(py, stream, this.device)?)
        };
        let writer = Mutex::new(Some(this.take(py)?));
        let got = sliced(
            py,
            timeout,
            || this.is_closing(),
            |py| closed_error(py, &this.name),
            |slice| {
                let w = lock(&writer)
                    .take()
                    .expect("the writer is here between slices");
                // A slice that times out leaves the generation reserved for the next (readers
                // whose holds outlast a slice cannot take it between them).
                match OwnedUpdate::begin_slice(w, Some(slice)) {
                    Ok(u) => Ok(Some(u)),
                    Err((w, Error::Timeout { .. })) => {
                        *lock(&writer) = Some(w);
                        Ok(None)
                    }
                    Err((w, e)) => {
                        *lock(&writer) = Some(w);
                        Err(Stop::Failed(e))
                    }
                }
            },
        );
        let update = match got {
            Ok(Some(u)) => u,
            Ok(None) => {
                if let Some(mut w) = lock(&writer).take() {
                    w.give_back_reservation();
                    this.give_back(py, w);
                }
                return Err(crate::util::timeout_error(
                    py,
                    "a tensor-set buffer",
                    timeout,
                ));
            }
            Err(e) => {
                // Closed, a signal, an error: the generation is takeable again.
                if let Some(mut w) = lock(&writer).take() {
                    w.give_back_reservation();
                    this.give_back(py, w);
                }
                return Err(e);
            }
        };
        if let Some(s) = target {
            // SAFETY: `s` is the stream the caller named or PyTorch's current stream, live for
            // the call (PyTorch's streams are never destroyed), or a default-stream sentinel.
            if let Err(e) = unsafe { update.update().ready_on_raw(s as _) } {
                this.give_back(py, update.into_writer());
                return Err(err(py, e));
            }
        }
        // Handed out unless `close()` came in the slice that took the buffer: decided under the
        // state's lock, where `close()` looks for the open update.
        let mut s = lock(&this.state);
        if s.closing.is_some() {
            drop(s);
            this.give_back(py, update.into_writer());
            return Err(closed_error(py, &this.name));
        }
        s.beginning = None;
        let cell = Arc::new(Mutex::new(Some(update)));
        *lock(&this.open) = Arc::downgrade(&cell);
        drop(s);
        Ok(TensorUpdate {
            update: cell,
            writer: slf.unbind(),
            target,
            ended: AtomicBool::new(false),
        })
    }

    /// Copies `tensors` (a dict of name → CUDA `torch.Tensor`, any subset of the set's names, each
    /// of the set's dtype and shape; or a `CopyPlan` of this writer) into a new
    /// generation and commits it: `begin`, `copy_from`, commit (`fingerprint=True`: with the
    /// fingerprint of the bytes, as `TensorUpdate.commit`). Returns the generation.
    ///
    /// Checked before a buffer is taken, so that a refusal changes nothing (an in-place set
    /// keeps its generation): `timeout`, that `tensors` is a dict or a `CopyPlan` of this writer,
    /// that PyTorch imports, that every key names a tensor of the set and every value is a
    /// `torch.Tensor`. A source refused by what only the copy reads (its dtype, shape, device or
    /// memory) aborts the update as `copy_from` does: an in-place set's generation is gone then
    /// (readers see nothing until the next commit).
    #[pyo3(signature = (tensors, timeout=None, *, stream=None, fingerprint=false))]
    fn publish(
        slf: Bound<'_, Self>,
        py: Python<'_>,
        tensors: &Bound<'_, PyAny>,
        timeout: Option<Seconds>,
        stream: Option<&Bound<'_, PyAny>>,
        fingerprint: bool,
    ) -> PyResult<u64> {
        let this = slf.get();
        timeout_arg(py, timeout)?;
        if let Ok(plan) = tensors.cast::<CopyPlan>() {
            plan.get().check_writer(py, &this.layout)?;
        } else if let Ok(d) = tensors.cast::<PyDict>() {
            let torch = tensors::Torch::get(py)?;
            let chunk = sources::Chunk {
                keys: d.keys(),
                values: d.values(),
            };
            sources::names(py, torch, &this.layout, this.index(py)?, &chunk)?;
        } else {
            return Err(errors::invalid_argument(
                py,
                format!(
                    "publish takes a dict of name -> tensor or a CopyPlan, got a {}",
                    tensors.get_type().name()?
                ),
            ));
        }
        let u = Self::begin(slf, py, timeout, stream)?;
        if let Err(e) = u.copy_from(py, tensors) {
            u.abort(py)?;
            return Err(e);
        }
        match u.commit(py, None, fingerprint) {
            Ok(g) => Ok(g),
            Err(e) => {
                // A failed fingerprint leaves the update open: give the buffer back.
                u.abort(py)?;
                Err(e)
            }
        }
    }

    /// A `CopyPlan` of `tensors` (a dict of name → contiguous CUDA `torch.Tensor` of the set's
    /// device, as `TensorUpdate.copy_from` takes) for GPU sets: the sources read once (and checked
    /// by the driver at the plan's first update), so that `copy_from(plan)` (or `publish(plan)`)
    /// at every later update reads only their `data_ptr()`s again (a trainer copying its
    /// parameters every step). The plan keeps the tensors and their storages alive and copies
    /// from them: a source given a new storage since (`set_`, `.data = ...`, a `resize_` that
    /// reallocates) is refused at the next update, not copied. Make it from the parameters
    /// themselves (`model.state_dict(keep_vars=True)`): `state_dict()` gives detached aliases,
    /// which keep the old storage when a parameter gets a new one, so a plan over them would go
    /// on copying the old values.
    ///
    /// Raises `InvalidArgument` for a host set, a non-contiguous source, and as `copy_from`.
    fn copy_plan(&self, py: Python<'_>, tensors: &Bound<'_, PyDict>) -> PyResult<CopyPlan> {
        let w = copy_plan::For {
            layout: &self.layout,
            index: self.index(py)?,
            device: (!self.host).then_some(self.device),
        };
        copy_plan::make(w, py, tensors)
    }

    /// The last generation committed (0: none).
    #[getter]
    fn generation(&self) -> u64 {
        *lock(&self.generation)
    }

    /// The set's name.
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// The layout fingerprint (32 bytes, SHA-256 of names, dtypes, shapes, strides and offsets):
    /// give it to readers as `expect_layout` so they refuse another checkpoint's layout.
    #[getter]
    fn layout_fingerprint<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.layout.fingerprint())
    }

    /// The tensors' names, in the set's order.
    #[getter]
    fn names<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.name_strs(py)?)
    }

    /// Bytes of one buffer (every tensor, with alignment).
    #[getter]
    fn nbytes(&self) -> u64 {
        self.layout.bytes_per_buffer()
    }

    /// Waits on the host until the writer's stream drained (its copies and ready words); a host
    /// set has no stream: returns at once. Raises `TensorSetClosed` once closed; on a GPU set
    /// `InvalidArgument` while an update is open.
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        // The state is locked without the GIL: a thread waiting for it while holding the GIL
        // (`begin`) must not wait on this one, which needs the GIL back to return.
        let host = self.host;
        let r = py.detach(|| match &lock(&self.state).slot {
            Slot::Closed => Err(true),
            _ if host => Ok(Ok(())),
            Slot::Idle(w) => Ok(w.stream().and_then(|s| s.synchronize())),
            Slot::Updating => Err(false),
        });
        match r {
            Ok(r) => r.map_err(|e| err(py, e)),
            Err(false) => Err(errors::invalid_argument(
                py,
                "an update of this tensor set is open".to_string(),
            )),
            Err(true) => Err(closed_error(py, &self.name)),
        }
    }

    /// Closes the set: its names go (no new reader opens it), waiting readers get
    /// `TensorSetClosed`, and the memory is freed after up to `timeout` seconds for readers'
    /// holds. Closing twice does nothing.
    ///
    /// The wait for holds runs without the GIL in 50 ms slices, checking for signals between
    /// them: Ctrl-C raises `KeyboardInterrupt` within a slice. The set is then closed (its names
    /// gone, `begin` raises `TensorSetClosed`) but its memory not freed yet: call `close()`
    /// again to finish (it waits anew, up to its own `timeout`), or let the writer be collected
    /// (which frees it after waiting up to 5 s).
    ///
    /// Safe from any thread. An open update is aborted (its buffer goes back uncommitted). A
    /// `begin` waiting in another thread raises `TensorSetClosed` within 50 ms, and this waits for
    /// it to give the writer back (at most 5 s), then closes the set; a close from within that
    /// `begin` (a signal handler) does not wait: the `begin` closes the set as it ends. After it,
    /// `begin`, `publish` and `synchronize` raise `TensorSetClosed`.
    #[pyo3(signature = (timeout=Seconds::Float(5.0)))]
    fn close(&self, py: Python<'_>, timeout: Seconds) -> PyResult<()> {
        let t = crate::util::seconds_arg(py, "timeout", timeout, false)?;
        lock(&self.dicts).clear();
        let me = std::thread::current().id();
        // Without the GIL: the wait below is for a `begin` that needs it to stop.
        let w = py.detach(|| {
            let mut s = lock(&self.state);
            match std::mem::replace(&mut s.slot, Slot::Closed) {
                Slot::Idle(w) => return Some(w),
                Slot::Closed => return None,
                Slot::Updating => {}
            }
            // An update is open: abort it (its buffer goes back uncommitted) and close.
            let cell = lock(&self.open).upgrade();
            if let Some(u) = cell.and_then(|c| lock(&c).take()) {
                return Some(u.into_writer());
            }
            // A `begin` has the writer (or an update's commit, which holds the GIL throughout
            // and so is never seen here): it comes back to be closed (`give_back`).
            s.slot = Slot::Updating;
            s.closing = Some(t);
            if !s.beginning.is_some_and(|b| b != me) {
                return None;
            }
            // The waiting `begin` sees `closing` before its next slice and gives the writer back,
            // which needs neither this lock (released while waiting) nor the GIL (released
            // above). Bounded all the same: should it not come back (a bug), this returns and
            // the `begin` closes the set as it ends.
            s.close_waits = true;
            s = self
                .back
                .wait_timeout_while(s, CLOSE_WAITS_FOR_ACQUIRE, |s| {
                    matches!(s.slot, Slot::Updating)
                })
                .unwrap_or_else(|p| p.into_inner())
                .0;
            s.close_waits = false;
            match std::mem::replace(&mut s.slot, Slot::Closed) {
                Slot::Idle(w) => Some(w),
                Slot::Closed => None,
                Slot::Updating => {
                    s.slot = Slot::Updating;
                    None
                }
            }
        });
        let Some(mut w) = w else {
            return Ok(());
        };
        let start = Instant::now();
        // What `close` waits for, in slices, so that Ctrl-C is seen (`sliced`).
        let waited = sliced(
            py,
            Some(t),
            || false,
            |py| closed_error(py, &self.name),
            |slice| Ok(w.wait_closing(slice).then_some(())),
        );
        if let Err(e) = waited {
            // A signal handler raised: the writer stays, its names gone, refused to `begin`
            // (`closing`); a later `close()` takes it and finishes (or its `Drop`).
            let mut s = lock(&self.state);
            s.slot = Slot::Idle(w);
            s.closing = Some(t);
            return Err(e);
        }
        let left = t.saturating_sub(start.elapsed());
        py.detach(|| w.close(left)).map_err(|e| err(py, e))
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<()> {
        self.close(py, Seconds::Float(5.0))
    }

    fn __repr__(&self) -> String {
        format!(
            "TensorSetWriter({:?}, {} tensors, {} bytes per buffer, generation {})",
            self.name,
            self.layout.len(),
            self.layout.bytes_per_buffer(),
            *lock(&self.generation)
        )
    }
}

/// A generation being written (`cuda_ipc::tensorset::Update`), from `TensorSetWriter.begin()`.
#[pyclass(module = "cuda_ipc", frozen)]
pub(crate) struct TensorUpdate {
    update: Arc<Mutex<Option<OwnedUpdate>>>,
    writer: Py<TensorSetWriter>,
    /// The raw stream the update's work runs on (GPU sets).
    target: Option<usize>,
    /// This object committed or aborted the update (else, once it has none, the writer's
    /// `close()` aborted it, maybe from another thread: leaving the `with` block raises).
    /// Relaxed: stored and loaded with the GIL held (pymethods), which orders them.
    ended: AtomicBool,
}

impl TensorUpdate {
    /// Runs `copy` ordered with the update's stream (GPU sets with one): the writer's stream
    /// waits for the work enqueued there so far first, and that stream for the copies after, so
    /// PyTorch reuses none of the sources' memory before they ran. The second wait is made on an
    /// error of `copy` too (copies it enqueued before the error still read their sources); the
    /// first error is returned.
    fn ordered(&self, py: Python<'_>, copy: impl FnOnce() -> PyResult<()>) -> PyResult<()> {
        if let Some(s) = self.target {
            self.with(py, |u| {
                // SAFETY: `s` is the update's stream (see `finish`).
                unsafe { u.update().publish_after_raw(s as _) }.map_err(|e| err(py, e))
            })?;
        }
        let r = copy();
        let after = match self.target {
            Some(s) => self.with(py, |u| {
                // SAFETY: as above.
                unsafe { u.update().ready_on_raw(s as _) }.map_err(|e| err(py, e))
            }),
            None => Ok(()),
        };
        r.and(after)
    }

    fn with<T>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut OwnedUpdate) -> PyResult<T>,
    ) -> PyResult<T> {
        let mut g = lock(&self.update);
        if let Some(u) = g.as_mut() {
            return f(u);
        }
        // Unlocked first: `close()` locks the writer's state, then this cell.
        drop(g);
        Err(err(py, self.finished()))
    }

    /// What a call on this update raises once it has none: `TensorSetClosed` when the writer was
    /// closed (which aborted the update, maybe from another thread), else `InvalidArgument`. Not
    /// called with the update's lock held (`close()` takes the writer's state, then that lock).
    fn finished(&self) -> Error {
        let w = self.writer.get();
        let closed = {
            let s = lock(&w.state);
            matches!(s.slot, Slot::Closed) || s.closing.is_some()
        };
        if closed {
            cuda_ipc::tensorset::TensorSetError::Closed(w.name.clone()).into()
        } else {
            Error::InvalidArgument("this update was committed or aborted".to_string())
        }
    }

    /// The digests of the update's tensors as its work so far leaves them, without the GIL: the
    /// work on the update's stream ordered first (GPU sets).
    fn digests_now(&self, py: Python<'_>) -> PyResult<Vec<[u8; 16]>> {
        py.detach(|| -> cuda_ipc::Result<Vec<[u8; 16]>> {
            let g = lock(&self.update);
            let Some(u) = g.as_ref() else {
                drop(g);
                return Err(self.finished());
            };
            if let Some(s) = self.target {
                // SAFETY: `s` is the stream `begin` resolved (the caller's or PyTorch's current
                // stream, live for the call, or a default-stream sentinel).
                unsafe { u.update().publish_after_raw(s as _) }?;
            }
            u.update().tensor_digests()
        })
        .map_err(|e| err(py, e))
    }

    /// The update's content fingerprint as its work so far leaves it.
    fn fingerprint_bytes(&self, py: Python<'_>) -> PyResult<[u8; 32]> {
        let d = self.digests_now(py)?;
        let layout = self.writer.get().layout.clone();
        cuda_ipc::tensorset::content::set_fingerprint(&layout, &d).map_err(|e| err(py, e))
    }

    /// Commits with `content` (`None`: none), or with the fingerprint of the bytes when
    /// `fingerprint` (computed first, the update still open: a failed fingerprint leaves it
    /// open, to commit again or abort).
    fn finish(
        &self,
        py: Python<'_>,
        mut content: Option<[u8; 32]>,
        fingerprint: bool,
    ) -> PyResult<u64> {
        if fingerprint {
            content = Some(self.fingerprint_bytes(py)?);
        }
        let taken = lock(&self.update).take();
        let Some(u) = taken else {
            return Err(err(py, self.finished()));
        };
        self.ended.store(true, Ordering::Relaxed);
        let writer = self.writer.get();
        // A fingerprint already ordered the writer's stream after the target's work.
        if let Some(s) = self.target.filter(|_| !fingerprint)
            && let Err(e) = {
                // SAFETY: `s` is the stream `begin` resolved (the caller's or PyTorch's current
                // stream, live for the call, or a default-stream sentinel).
                unsafe { u.update().publish_after_raw(s as _) }
            }
        {
            writer.give_back(py, u.into_writer());
            return Err(err(py, e));
        }
        let (w, r) = u.commit(content.unwrap_or([0; 32]));
        writer.give_back(py, w);
        r.map_err(|e| err(py, e))
    }
}

#[pymethods]
impl TensorUpdate {
    /// The generation this update will publish.
    #[getter]
    fn generation(&self, py: Python<'_>) -> PyResult<u64> {
        self.with(py, |u| Ok(u.update().generation()))
    }

    /// The buffer being written.
    #[getter]
    fn buffer(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |u| Ok(u.update().buffer()))
    }

    /// The tensors of this update's buffer as writable `torch.Tensor`s (a new dict of the same
    /// tensors for every update of this buffer; they are views of the set's memory, valid while
    /// the writer lives). Write them on the update's stream (PyTorch's current stream at `begin`,
    /// unless `stream=` was given). A host set gives CPU tensors over its shared memory: write
    /// them before the commit, as `write` does.
    fn tensors<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let writer = self.writer.get();
        let buffer = self.with(py, |u| Ok(u.update().buffer()))?;
        let cached = lock(&writer.dicts).get(&buffer).map(|d| d.clone_ref(py));
        if let Some(d) = cached {
            return d.bind(py).copy();
        }
        let layout = writer.layout.clone();
        let bases = self.with(py, |u| {
            let up = u.update();
            tensors::allocation_bases(&layout, |i| {
                if writer.host {
                    let base = up.as_mut_ptr()? as u64;
                    Ok(base + layout.tensors()[i].offset)
                } else {
                    up.tensor_ptr(i)
                }
            })
            .map_err(|e| err(py, e))
        })?;
        let device = if writer.host { -1 } else { writer.device };
        let d = tensors::build(py, &layout, &bases, device, writer.name_strs(py)?, None)?;
        lock(&writer.dicts).insert(buffer, d.clone().unbind());
        d.copy()
    }

    /// Copies `tensors` (a dict of name → CUDA `torch.Tensor` of the set's device: any subset of
    /// the set's names, each of the set's dtype and shape; made contiguous first if it
    /// is not) into this update's buffer, on the writer's stream after the work enqueued so far
    /// on the update's stream; the update's stream then waits for the copies, so PyTorch reuses
    /// none of the sources' memory before they ran (with non-contiguous sources, PyTorch's
    /// current stream, where their contiguous copies are made, is ordered both ways too).
    /// Tensors back to back both in the set and in the sources are copied as one range, the
    /// ranges as `cuda_ipc::tensorset::Update::copy_many` copies them (many small ones by a
    /// kernel, 160 per launch, large ones by `cuMemcpyDtoDAsync`; before the kernel reads a
    /// source, the driver says whether its memory is readable device memory of the set's device,
    /// and the driver's own copies check theirs). A source that is a
    /// view of this update's own buffer must be its own tensor (else the bytes that land are
    /// unspecified). A host set copies from CPU tensors. A tensor of the set that is a strided
    /// view (a transposed parameter of an `over_tensors` set) is refused: a copy of contiguous
    /// bytes would scramble it; update it in place. The sources are read and copied in
    /// chunks (64 tensors first, up to 512), so on an error the chunks before the bad tensor's may already be copied:
    /// the update stays open and uncommitted (abort it, or copy again).
    ///
    /// `tensors` may also be a `CopyPlan` of this writer (`TensorSetWriter.copy_plan`): its
    /// sources, read when it was made, are copied 320 at a time, each chunk after one bulk
    /// `data_ptr()` pass over it that refuses the update, before that chunk is copied, if any of
    /// them moved (earlier chunks may be copied by then: the update stays open and uncommitted;
    /// abort it, or copy again).
    pub(crate) fn copy_from(&self, py: Python<'_>, tensors: &Bound<'_, PyAny>) -> PyResult<()> {
        let writer = self.writer.get();
        if let Ok(plan) = tensors.cast::<CopyPlan>() {
            let plan = plan.get();
            plan.check_writer(py, &writer.layout)?;
            let check = plan.needs_check();
            self.ordered(py, || {
                for chunk in &plan.chunks {
                    plan.check_chunk(py, chunk)?;
                    self.with(py, |u| {
                        // The plan's sources were read as contiguous CUDA tensors of the set's
                        // device; it keeps them and their storages alive, `check_chunk` found
                        // each of the chunk where its range was made from, and the plan's first
                        // update has the driver check them.
                        // SAFETY: hence `copy_gpu`'s obligations 1–3.
                        unsafe { copy_gpu(py, u, &chunk.ranges, check) }
                    })?;
                }
                Ok(())
            })?;
            if check {
                plan.checked_now();
            }
            return Ok(());
        }
        let Ok(tensors) = tensors.cast::<PyDict>() else {
            return Err(errors::invalid_argument(
                py,
                format!(
                    "copy_from takes a dict of name -> tensor or a CopyPlan, got a {}",
                    tensors.get_type().name()?
                ),
            ));
        };
        let torch = tensors::Torch::get(py)?;
        let layout = &writer.layout;
        let index = writer.index(py)?;
        let keys = tensors.keys();
        let values = tensors.values();
        let mut keep = Vec::new();
        // The stream PyTorch makes contiguous copies of non-contiguous sources on (its current
        // one), once there are any: the writer's stream waits for it before a chunk's copies,
        // and it for the copies at the end, before the copies' memory goes back to PyTorch.
        let mut made_on: Option<usize> = None;
        let device = (!writer.host).then_some(writer.device);
        let r = self.ordered(py, || {
            let (mut at, mut len) = (0, 0);
            while at < keys.len() {
                len = sources::next_chunk(len, keys.len() - at);
                let end = at + len;
                let chunk = sources::Chunk {
                    keys: keys.get_slice(at, end),
                    values: values.get_slice(at, end),
                };
                at = end;
                let before = keep.len();
                let copies =
                    sources::read(py, torch, layout, index, &chunk, device, Some(&mut keep))?;
                if !writer.host && keep.len() > before && made_on.is_none() {
                    made_on = Some(work_stream(py, None, writer.device)?);
                }
                self.with(py, |u| {
                    if writer.host {
                        for (_, off, src, n) in coalesce(layout, copies.iter()) {
                            // `sources::read` checked device, contiguity and `nbytes`.
                            // SAFETY: `n` bytes of contiguous private CPU tensors, alive by
                            // `chunk`/`keep` until this returns.
                            let src = unsafe { std::slice::from_raw_parts(src as *const u8, n) };
                            u.write_at(off as usize, src).map_err(|e| err(py, e))?;
                        }
                        return Ok(());
                    }
                    if let Some(s) = made_on.filter(|_| keep.len() > before) {
                        // SAFETY: `s` is PyTorch's current stream of the set's device, live.
                        unsafe { u.update().publish_after_raw(s as _) }.map_err(|e| err(py, e))?;
                    }
                    // `sources::read` checked device, contiguity and `nbytes`; `chunk`/`keep` keep
                    // every source alive until the copies are ordered (`ordered`, `made_on`).
                    // SAFETY: hence `copy_gpu`'s obligations 1 and 3; `check` for 2.
                    unsafe { copy_gpu(py, u, &coalesce(layout, copies.iter()), true) }
                })?;
            }
            Ok(())
        });
        // Also after an error: copies enqueued before it still read the contiguous copies, which
        // go back to PyTorch (on `made_on`) when `keep` drops.
        let after = match made_on {
            Some(s) => self.with(py, |u| {
                // SAFETY: as above.
                unsafe { u.update().ready_on_raw(s as _) }.map_err(|e| err(py, e))
            }),
            None => Ok(()),
        };
        drop(keep);
        r.and(after)
    }

    /// Copies the last committed generation into this buffer (buffered sets; nothing to do in
    /// place), on the writer's stream.
    fn copy_from_previous(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, |u| u.copy_from_previous().map_err(|e| err(py, e)))
    }

    /// Writes `data` (bytes-like) over the first `len(data)` bytes of tensor `name` (host sets).
    fn write(&self, py: Python<'_>, name: &str, data: &Bound<'_, PyAny>) -> PyResult<()> {
        let writer = self.writer.get();
        let i = writer.layout.index_of(name).ok_or_else(|| {
            err(
                py,
                cuda_ipc::tensorset::TensorSetError::NoSuchTensor(format!("{name:?}")).into(),
            )
        })?;
        let bytes = crate::util::bytes_of(data)?;
        let src = bytes.as_bytes();
        self.with(py, |u| u.write_tensor(i, src).map_err(|e| err(py, e)))
    }

    /// The content fingerprint of the update's bytes as its work so far leaves them (32 bytes;
    /// on a GPU set a kernel after that work, waited for, without the GIL): commit with it
    /// (`commit(content=fp)`) and hand it to readers for `expect_content`.
    fn fingerprint<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let f = self.fingerprint_bytes(py)?;
        Ok(PyBytes::new(py, &f))
    }

    /// The content digest of each tensor as the work so far leaves it (16 bytes each, in the
    /// set's order).
    fn tensor_digests<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let d = self.digests_now(py)?;
        Ok(d.iter().map(|x| PyBytes::new(py, x)).collect())
    }

    /// Publishes the generation; returns its number. Its ready word is written on the writer's
    /// stream after the work enqueued on the update's stream. `content`: a 32-byte content
    /// fingerprint of your own readers may demand; `fingerprint=True`: the fingerprint of the
    /// bytes themselves, computed where they lie (on a GPU set a kernel after the update's work,
    /// which the commit then waits for), which readers check with `TensorHold.verify_content()`.
    /// Both at once is a `ValueError`; a failed fingerprint publishes nothing and leaves the
    /// update open (commit again, or abort).
    #[pyo3(signature = (content=None, fingerprint=false))]
    fn commit(
        &self,
        py: Python<'_>,
        content: Option<&Bound<'_, PyAny>>,
        fingerprint: bool,
    ) -> PyResult<u64> {
        if fingerprint && content.is_some() {
            return Err(errors::invalid_argument(
                py,
                "content and fingerprint=True: give one or the other".to_string(),
            ));
        }
        let content = crate::util::fingerprint_arg(py, "content", content)?;
        self.finish(py, content, fingerprint)
    }

    /// Gives the buffer back uncommitted (in place: the generation it held is gone and readers
    /// see nothing until the next commit). Aborting twice does nothing.
    fn abort(&self, py: Python<'_>) -> PyResult<()> {
        let taken = lock(&self.update).take();
        if let Some(u) = taken {
            self.ended.store(true, Ordering::Relaxed);
            self.writer.get().give_back(py, u.into_writer());
        }
        Ok(())
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (exc_type=None, _exc=None, _tb=None))]
    fn __exit__(
        &self,
        py: Python<'_>,
        exc_type: Option<&Bound<'_, PyAny>>,
        _exc: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        if exc_type.is_some_and(|e| !e.is_none()) {
            self.abort(py)?;
        } else if lock(&self.update).is_some() {
            self.finish(py, None, false)?;
        } else if !self.ended.load(Ordering::Relaxed) {
            // The block ended without an exception and without a commit of its own, but the
            // writer's `close()` aborted the update: nothing was published, which must not pass
            // unseen (`TensorSetClosed`).
            return Err(err(py, self.finished()));
        }
        Ok(false)
    }

    fn __repr__(&self) -> String {
        match lock(&self.update).as_ref() {
            Some(u) => format!(
                "TensorUpdate(generation {}, buffer {})",
                u.update().generation(),
                u.update().buffer()
            ),
            None => "TensorUpdate(finished)".to_string(),
        }
    }
}

impl Drop for TensorUpdate {
    fn drop(&mut self) {
        // Collected while open: give the writer back uncommitted, so the set stays usable.
        let taken = lock(&self.update).take();
        if let Some(u) = taken {
            Python::attach(|py| self.writer.get().give_back(py, u.into_writer()));
        }
    }
}
