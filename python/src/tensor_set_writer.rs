//! The `TensorSetWriter` class (`cuda_ipc::tensorset::TensorSetWriter`); its updates are
//! `TensorUpdate`s (`tensor_update.rs`).
//!
//! Streams: an update is written on PyTorch's current stream of the set's device (or the
//! `stream=` given to `begin`): `begin` makes that stream wait on the GPU for the writer's stream,
//! which waits for the readers' release words, and the commit makes the writer's stream wait for
//! that stream before it writes the generation's ready word. The host never waits for the GPU.

use crate::args::{
    Int, Seconds, Text, device_arg, host_stream_refused, memory_arg, opt_text, timeout_arg,
};
use crate::copy_plan::{self, CopyPlan};
use crate::errors;
use crate::sources;
use crate::tensor_update::TensorUpdate;
use crate::tensors::{self, specs_arg};
use crate::util::{CLOSE_WAITS_FOR_ACQUIRE, Stop, err, lock, sliced, work_stream};
use crate::writer_core::{RustWriter, Slot, WriterCore, closed_error};
use cuda_ipc::Error;
use cuda_ipc::channel::MemoryKind;
use cuda_ipc::driver::{Context, Device};
use cuda_ipc::tensorset::owned::OwnedUpdate;
use cuda_ipc::tensorset::{GenerationMode, TensorSetOptions, TensorSpec};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// The writing end of a tensor set (`cuda_ipc::tensorset::TensorSetWriter`).
///
/// In a child made by `fork()` after the parent made it, the set is the parent's: `begin`,
/// `publish`, `copy_plan`, `wait_readers` and `synchronize` raise `NotSupported`, taking no lock;
/// `close()`, the end of a `with` block, the exit and its collection close nothing; `name`,
/// `names`, `nbytes`, `layout_fingerprint` and `generation` describe the copy (the last generation
/// committed before the fork).
#[pyclass(module = "cuda_ipc", frozen)]
pub(crate) struct TensorSetWriter {
    /// Shared with the open update, which gives the Rust writer back to it.
    core: Arc<WriterCore>,
}

/// Buffers of a `"buffered"` set when `buffers` is not given.
const DEFAULT_BUFFERS: usize = 2;

/// The generation mode of `mode` and `buffers` (`None`: not given). `buffers` means something
/// only for `"buffered"` (default [`DEFAULT_BUFFERS`]), which takes 2 to 16 and says so (a count
/// outside was refused as "from 1 to 16", though 1 is no buffered set's count either); given with
/// `"in_place"`, which has one buffer, any value is refused rather than ignored.
fn mode_arg(py: Python<'_>, mode: &str, buffers: Option<Int>) -> PyResult<GenerationMode> {
    match (mode, buffers) {
        ("in_place", None) => Ok(GenerationMode::InPlace),
        ("in_place", Some(n)) => {
            let n = match n {
                Int::Small(v) => v.to_string(),
                Int::Huge(_) => "an int beyond 128 bits".to_string(),
                Int::Bool(b) => format!("a bool ({})", if b { "True" } else { "False" }),
            };
            Err(errors::invalid_argument(
                py,
                format!(
                    "buffers={n} with mode=\"in_place\", which has one buffer: give buffers \
                     only with mode=\"buffered\""
                ),
            ))
        }
        ("buffered", None) => Ok(GenerationMode::Buffered(DEFAULT_BUFFERS)),
        ("buffered", Some(n)) => Ok(GenerationMode::Buffered(n.within(
            py,
            "buffers",
            2,
            cuda_ipc::channel::MAX_BUFFERS,
        )?)),
        (m, _) => Err(errors::invalid_argument(
            py,
            format!("mode must be \"in_place\" or \"buffered\", got {m:?}"),
        )),
    }
}

impl TensorSetWriter {
    fn over(
        py: Python<'_>,
        w: RustWriter,
        device: i32,
        keep: Option<Py<PyDict>>,
    ) -> TensorSetWriter {
        let core = Arc::new(WriterCore::new(w, device, keep));
        crate::util::close_at_exit_later(py, &(core.clone() as Arc<dyn crate::util::CloseAtExit>));
        TensorSetWriter { core }
    }
}

#[pymethods]
impl TensorSetWriter {
    /// Creates tensor set `name` holding `tensors` (a dict of name → `torch.Tensor`, whose shapes
    /// and dtypes are taken, or name → `(shape, dtype)`), laid out contiguous in one allocation
    /// per buffer on CUDA device `device`; nothing is published until the first commit.
    /// `quota`: reserve the set's bytes (buffers × bytes) from a shared budget (`"user"` or
    /// `"group:GID"`, as `Producer`'s), raising `OverQuota` past it. `buffers`: of a
    /// `"buffered"` set (default 2); given with `"in_place"` (one buffer), `InvalidArgument`.
    #[new]
    #[pyo3(signature = (name, tensors, *, device=Int::Small(0), memory=Text::lit("vmm"),
        mode=Text::lit("in_place"), buffers=None, max_readers=Int::Small(64), quota=None))]
    #[pyo3(
        text_signature = "(name, tensors, *, device=0, memory=\"vmm\", mode=\"in_place\", \
        buffers=None, max_readers=64, quota=None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        name: Text,
        tensors: &Bound<'_, PyDict>,
        device: Int,
        memory: Text,
        mode: Text,
        buffers: Option<Int>,
        max_readers: Int,
        quota: Option<Text>,
    ) -> PyResult<Self> {
        let name = name.into_string(py, "name")?;
        let memory = memory.get(py, "memory")?;
        let mode = mode.get(py, "mode")?;
        let quota = opt_text(py, "quota", &quota)?;
        let device = device_arg(py, device)?;
        let generations = mode_arg(py, mode, buffers)?;
        let max_readers: usize =
            max_readers.within(py, "max_readers", 1, cuda_ipc::channel::MAX_CONSUMERS)?;
        let specs = specs_arg(py, tensors)?;
        let kind = memory_arg(py, memory)?;
        let mut opts = TensorSetOptions::new()
            .memory(kind)
            .mode(generations)
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
        Ok(Self::over(py, w, device as i32, None))
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
        name: Text,
        tensors: &Bound<'_, PyDict>,
        device: Int,
        max_readers: Int,
    ) -> PyResult<Self> {
        let name = name.into_string(py, "name")?;
        let device = device_arg(py, device)?;
        let max_readers: usize =
            max_readers.within(py, "max_readers", 1, cuda_ipc::channel::MAX_CONSUMERS)?;
        let torch = tensors::Torch::get(py)?;
        let mut chunks: Vec<(usize, cuda_ipc::ipc::VmmBuffer)> = Vec::new();
        let mut located: Vec<(TensorSpec, u32, u64)> = Vec::with_capacity(tensors.len());
        // The items at once: a `__getattr__` of the caller's that changes the dict changes
        // nothing here.
        for item in tensors.items().iter() {
            let (k, t): (Bound<'_, PyAny>, Bound<'_, PyAny>) = item.extract()?;
            let name = tensors::tensor_name(py, &k)?;
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
        Ok(Self::over(
            py,
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
    /// One `begin()` may be open or waiting at a time: another `begin()` or `publish()`
    /// meanwhile, from any thread, raises `InvalidArgument` at once, without waiting (try again
    /// after its commit or abort). `NotSupported` in a forked child.
    #[pyo3(signature = (timeout=None, *, stream=None))]
    fn begin(
        slf: Bound<'_, Self>,
        py: Python<'_>,
        timeout: Option<Seconds>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<TensorUpdate> {
        let this = slf.get();
        this.core.check_fork("tensor set writer")?;
        let timeout = timeout_arg(py, timeout)?;
        let target = if this.core.host {
            host_stream_refused(py, stream)?;
            None
        } else {
            Some(work_stream(py, stream, this.core.device)?)
        };
        let writer = Mutex::new(Some(this.core.take(py)?));
        let got = sliced(
            py,
            timeout,
            || this.core.is_closing(),
            |py| closed_error(py, &this.core.name),
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
                    this.core.give_back(py, w);
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
                    this.core.give_back(py, w);
                }
                return Err(e);
            }
        };
        if let Some(s) = target {
            // SAFETY: `s` is the stream the caller named or PyTorch's current stream, live for
            // the call (PyTorch's streams are never destroyed), or a default-stream sentinel.
            if let Err(e) = unsafe { update.update().ready_on_raw(s as _) } {
                this.core.give_back(py, update.into_writer());
                return Err(err(py, e));
            }
        }
        // Handed out unless `close()` came in the slice that took the buffer: decided under the
        // state's lock, where `close()` looks for the open update.
        let mut s = lock(&this.core.state);
        if s.closing.is_some() {
            drop(s);
            this.core.give_back(py, update.into_writer());
            return Err(closed_error(py, &this.core.name));
        }
        s.beginning = None;
        let cell = Arc::new(Mutex::new(Some(update)));
        *lock(&this.core.open) = Arc::downgrade(&cell);
        drop(s);
        Ok(TensorUpdate::new(cell, this.core.clone(), target))
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
    /// (readers see nothing until the next commit). `NotSupported` in a forked child, before
    /// anything else is checked.
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
        this.core.check_fork("tensor set writer")?;
        timeout_arg(py, timeout)?;
        if this.core.host {
            host_stream_refused(py, stream)?;
        }
        if let Ok(plan) = tensors.cast::<CopyPlan>() {
            plan.get().check_writer(py, &this.core.layout)?;
        } else if let Ok(d) = tensors.cast::<PyDict>() {
            let torch = tensors::Torch::needed(
                py,
                "publish(dict) reads torch.Tensor sources",
                this.core.host,
            )?;
            let chunk = sources::Chunk {
                keys: d.keys(),
                values: d.values(),
            };
            sources::names(py, torch, &this.core.layout, this.core.index(py)?, &chunk)?;
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
    /// Raises `InvalidArgument` for a host set, a non-contiguous source, and as `copy_from`;
    /// `NotSupported` in a forked child (no update of this writer is made there).
    fn copy_plan(&self, py: Python<'_>, tensors: &Bound<'_, PyDict>) -> PyResult<CopyPlan> {
        self.core.check_fork("tensor set writer")?;
        let w = copy_plan::For {
            layout: &self.core.layout,
            index: self.core.index(py)?,
            device: (!self.core.host).then_some(self.core.device),
        };
        copy_plan::make(w, py, tensors)
    }

    /// Waits up to `timeout` seconds (`None`: no bound) until every reader has taken the newest
    /// generation (each reader attached when it was committed has held it, or a later one;
    /// readers that open the set later start at it) and returns whether they all have. Call it
    /// before `close()` to let readers waiting in `wait_newer` get the last generation: the close
    /// takes every generation from readers as it begins. A dead reader holds nothing up; a live
    /// one that never asks keeps the wait until its timeout. Waits without the GIL in 50 ms
    /// slices (Ctrl-C raises `KeyboardInterrupt`). Raises `TensorSetClosed` once closed, and
    /// `InvalidArgument` while an update is open or another thread waits in `begin()`;
    /// `NotSupported` in a forked child.
    #[pyo3(signature = (timeout=None))]
    fn wait_readers(&self, py: Python<'_>, timeout: Option<Seconds>) -> PyResult<bool> {
        let timeout = timeout_arg(py, timeout)?;
        let w = self.core.take(py)?;
        let got = sliced(
            py,
            timeout,
            || self.core.is_closing(),
            |py| closed_error(py, &self.core.name),
            |slice| match w.wait_readers(Some(slice)) {
                Ok(true) => Ok(Some(())),
                Ok(false) => Ok(None),
                Err(e) => Err(Stop::Failed(e)),
            },
        );
        self.core.give_back(py, w);
        Ok(got?.is_some())
    }

    /// The last generation committed (0: none).
    #[getter]
    fn generation(&self) -> u64 {
        *lock(&self.core.generation)
    }

    /// The set's name.
    #[getter]
    fn name(&self) -> &str {
        &self.core.name
    }

    /// The layout fingerprint (32 bytes, SHA-256 of names, dtypes, shapes, strides and offsets):
    /// give it to readers as `expect_layout` so they refuse another checkpoint's layout.
    #[getter]
    fn layout_fingerprint<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.core.layout.fingerprint())
    }

    /// The tensors' names, in the set's order.
    #[getter]
    fn names<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.core.name_strs(py)?)
    }

    /// Bytes of one buffer (every tensor, with alignment).
    #[getter]
    fn nbytes(&self) -> u64 {
        self.core.layout.bytes_per_buffer()
    }

    /// Waits on the host until the writer's stream drained (its copies and ready words); a host
    /// set has no stream: returns at once. Raises `TensorSetClosed` once closed; on a GPU set
    /// `InvalidArgument` while an update is open; `NotSupported` in a forked child (the stream is
    /// the parent's), before the state is locked.
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        self.core.check_fork("tensor set writer")?;
        // The state is locked without the GIL: a thread waiting for it while holding the GIL
        // (`begin`) must not wait on this one, which needs the GIL back to return.
        let host = self.core.host;
        let r = py.detach(|| match &lock(&self.core.state).slot {
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
            Err(true) => Err(closed_error(py, &self.core.name)),
        }
    }

    /// Closes the set: from its start no hold is granted (readers' `current()`, `wait_newer()`
    /// and `wait_newer_async()` raise `TensorSetClosed`, also in readers that ask again and
    /// again; a generation a reader took before, whose awaited wait was cancelled, is still
    /// handed to that reader's next call: the hold is one taken before), its names go (no new reader opens it), and the memory is freed once the holds
    /// taken before have ended (it returns as soon as they do), or after `timeout` seconds (default
    /// 5, 0 to 1e9; `None`: without bound, as every `timeout=None`), when the holds left are
    /// forced. Closing twice does nothing, but a second `close()` while
    /// another thread's close frees the set returns once that one has (within its own
    /// `timeout`), so the name can be created again after it.
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
    /// `begin`, `publish` and `synchronize` raise `TensorSetClosed`. In a forked child it closes
    /// nothing and returns at once: the set is the parent's.
    #[pyo3(signature = (timeout=Some(Seconds::Float(5.0))))]
    #[pyo3(text_signature = "($self, timeout=5.0)")]
    fn close(&self, py: Python<'_>, timeout: Option<Seconds>) -> PyResult<()> {
        let t = crate::args::close_timeout_arg(py, timeout)?;
        self.close_for(py, t)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<()> {
        self.close(py, Some(Seconds::Float(5.0)))
    }

    fn __repr__(&self) -> String {
        format!(
            "TensorSetWriter({:?}, {}, {} per buffer, generation {})",
            self.core.name,
            crate::errors::plural(self.core.layout.len(), "tensor"),
            crate::errors::bytes(self.core.layout.bytes_per_buffer()),
            *lock(&self.core.generation)
        )
    }
}

impl TensorSetWriter {
    /// `close(timeout)`, `t` checked.
    fn close_for(&self, py: Python<'_>, t: std::time::Duration) -> PyResult<()> {
        if self.core.fork.inherited() {
            return Ok(()); // a forked child's copy: the parent's set stays open
        }
        // No hold is granted from here on, whoever has the writer now (a `begin` of another
        // thread gives it back within a slice, and the close goes on then).
        py.detach(|| self.core.closer.withdraw());
        lock(&self.core.dicts).clear();
        let me = std::thread::current().id();
        // Without the GIL: the wait below is for a `begin` that needs it to stop.
        // The writer to close, with the close marked as finishing under the state's lock
        // (`Finish`: a second `close()` that finds the slot closed waits for this one).
        let w = py.detach(|| {
            let mut s = lock(&self.core.state);
            match std::mem::replace(&mut s.slot, Slot::Closed) {
                Slot::Idle(w) => return Some((w, self.core.finish.start())),
                Slot::Closed => return None,
                Slot::Updating => {}
            }
            // An update is open: abort it (its buffer goes back uncommitted) and close.
            let cell = lock(&self.core.open).upgrade();
            if let Some(u) = cell.and_then(|c| lock(&c).take()) {
                return Some((u.into_writer(), self.core.finish.start()));
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
                .core
                .back
                .wait_timeout_while(s, CLOSE_WAITS_FOR_ACQUIRE, |s| {
                    matches!(s.slot, Slot::Updating)
                })
                .unwrap_or_else(|p| p.into_inner())
                .0;
            s.close_waits = false;
            match std::mem::replace(&mut s.slot, Slot::Closed) {
                Slot::Idle(w) => Some((w, self.core.finish.start())),
                Slot::Closed => None,
                Slot::Updating => {
                    s.slot = Slot::Updating;
                    None
                }
            }
        });
        let Some((mut w, _finishing)) = w else {
            // Closed already, or being closed by another `close()` (or by the `begin` that has
            // the writer as it ends): returns once that close has finished, within `timeout`.
            // A close interrupted (Ctrl-C) hands the writer back, closed but not freed: then
            // this one finishes it.
            let back = || matches!(lock(&self.core.state).slot, Slot::Idle(_));
            if self.core.finish.wait_or_take_over(py, t, back)? {
                return self.close_for(py, t);
            }
            return Ok(());
        };
        let start = Instant::now();
        // What `close` waits for, in slices, so that Ctrl-C is seen (`sliced`).
        let waited = sliced(
            py,
            Some(t),
            || false,
            |py| closed_error(py, &self.core.name),
            |slice| Ok(w.wait_closing(slice).then_some(())),
        );
        if let Err(e) = waited {
            // A signal handler raised: the writer stays, its names gone, refused to `begin`
            // (`closing`); a later `close()` takes it and finishes (or its `Drop`).
            let mut s = lock(&self.core.state);
            s.slot = Slot::Idle(w);
            s.closing = Some(t);
            return Err(e);
        }
        let left = t.saturating_sub(start.elapsed());
        py.detach(|| w.close(left))
            .map(|_| ())
            .map_err(|e| err(py, e))
    }
}
