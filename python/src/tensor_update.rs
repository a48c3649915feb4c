//! The `TensorUpdate` class (`cuda_ipc::tensorset::Update`): a generation being written, from
//! `TensorSetWriter.begin()` (`tensor_set_writer.rs`), which owns the Rust writer between
//! updates and gets it back from here at the commit or abort.
//!
//! Streams: the update's work runs on its stream (PyTorch's current stream of the set's device
//! at `begin`, or `stream=`); copies and the commit are ordered after it on the GPU, never by
//! the host waiting.

use crate::args::Text;
use crate::copy_plan::CopyPlan;
use crate::errors::{self, bytes};
use crate::sources::{self, coalesce, copy_gpu};
use crate::tensors;
use crate::util::{err, lock, work_stream};
use crate::writer_core::WriterCore;
use cuda_ipc::Error;
use cuda_ipc::tensorset::owned::OwnedUpdate;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// A generation being written (`cuda_ipc::tensorset::Update`), from `TensorSetWriter.begin()`.
///
/// Once committed or aborted (also by the writer's `close()`), `generation` and `buffer` still
/// answer, as a released `TensorHold`'s do: the generation it published, or, aborted, the one it
/// would have published (which the writer's next update takes then), and the buffer it wrote.
/// Its other calls raise (`InvalidArgument`, or `TensorSetClosed` once the writer closed it),
/// but `abort()`, which does nothing.
///
/// In a child made by `fork()` while the parent had it open, the update is the parent's: every
/// call (the end of a `with` block included) raises `NotSupported`, taking no lock, writing,
/// copying and committing nothing; its collection gives nothing back (the parent commits or
/// aborts it); `generation` and `buffer` describe the copy.
#[pyclass(module = "cuda_ipc", frozen)]
pub(crate) struct TensorUpdate {
    /// The generation and buffer of the update: readable after its end too.
    generation: u64,
    buffer: usize,
    update: Arc<Mutex<Option<OwnedUpdate>>>,
    writer: Arc<WriterCore>,
    /// The raw stream the update's work runs on (GPU sets).
    target: Option<usize>,
    /// This object committed or aborted the update (else, once it has none, the writer's
    /// `close()` aborted it, maybe from another thread: leaving the `with` block raises).
    /// Relaxed: stored and loaded with the GIL held (pymethods), which orders them.
    ended: AtomicBool,
}

impl TensorUpdate {
    /// `NotSupported` in a process forked from the one that made the writer: the first step of
    /// every call, before the update's cell (which a parent's fingerprint holds without the GIL)
    /// or the writer's state is locked, and before PyTorch is asked for anything.
    fn check_fork(&self) -> PyResult<()> {
        self.writer.check_fork("tensor set update")
    }

    /// The update in `update` (a cell `writer` keeps a weak reference to, so its `close()` can
    /// abort it), its work on raw stream `target` (GPU sets).
    pub(crate) fn new(
        update: Arc<Mutex<Option<OwnedUpdate>>>,
        writer: Arc<WriterCore>,
        target: Option<usize>,
    ) -> TensorUpdate {
        let (generation, buffer) = lock(&update)
            .as_ref()
            .map_or((0, 0), |u| (u.update().generation(), u.update().buffer()));
        TensorUpdate {
            generation,
            buffer,
            update,
            writer,
            target,
            ended: AtomicBool::new(false),
        }
    }

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
        self.check_fork()?;
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
        let w = &self.writer;
        if w.is_closed() {
            cuda_ipc::tensorset::TensorSetError::Closed(w.name.clone()).into()
        } else {
            Error::InvalidArgument("this update was committed or aborted".to_string())
        }
    }

    /// The digests of the update's tensors as its work so far leaves them, without the GIL: the
    /// work on the update's stream ordered first (GPU sets).
    fn digests_now(&self, py: Python<'_>) -> PyResult<Vec<[u8; 16]>> {
        self.check_fork()?;
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
        let layout = self.writer.layout.clone();
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
        self.check_fork()?;
        if fingerprint {
            content = Some(self.fingerprint_bytes(py)?);
        }
        let taken = lock(&self.update).take();
        let Some(u) = taken else {
            return Err(err(py, self.finished()));
        };
        self.ended.store(true, Ordering::Relaxed);
        let writer = &self.writer;
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
    /// The generation this update publishes (what `commit()` returns); after the commit, the
    /// generation it published; after an abort, the one it would have published (the writer's
    /// next update takes that number then).
    #[getter]
    fn generation(&self) -> u64 {
        self.generation
    }

    /// The buffer being written (after the update's end, the buffer it wrote).
    #[getter]
    fn buffer(&self) -> usize {
        self.buffer
    }

    /// The tensors of this update's buffer as writable `torch.Tensor`s (a new dict of the same
    /// tensors for every update of this buffer; they are views of the set's memory, valid while
    /// the writer lives). Write them on the update's stream (PyTorch's current stream at `begin`,
    /// unless `stream=` was given). A host set gives CPU tensors over its shared memory: write
    /// them before the commit, as `write` does. `NotSupported` in a forked child (also for the
    /// dict a parent's call built: its tensors are views of the parent's buffer).
    fn tensors<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.check_fork()?;
        let writer = &self.writer;
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
    ///
    /// `NotSupported` in a forked child, before the sources are looked at; once the update was
    /// committed or aborted, `InvalidArgument` (`TensorSetClosed` when the writer's close aborted
    /// it), before that too.
    pub(crate) fn copy_from(&self, py: Python<'_>, tensors: &Bound<'_, PyAny>) -> PyResult<()> {
        self.check_fork()?;
        // An update that ended says so before its sources are looked at (or PyTorch imported).
        self.with(py, |_| Ok(()))?;
        let writer = &self.writer;
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
        let torch = tensors::Torch::needed(
            py,
            "copy_from(dict) reads torch.Tensor sources",
            writer.host,
        )?;
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
    ///
    /// The bytes are copied as they are, never converted: plain bytes (`bytes`, `bytearray`, a
    /// `"B"` memoryview such as `memoryview(a).cast("B")`) into a tensor of any dtype; any other
    /// buffer only when its items are of the tensor's element size (an `int32` array into a
    /// `float32` tensor is copied bit for bit, the caller's choice). `InvalidArgument` for a
    /// buffer whose items are of another size (a `float64` array into a `float32` tensor:
    /// convert it first) and for a buffer of Python objects (a NumPy array of `dtype=object`,
    /// whose bytes are pointers). `NotSupported` in a forked child.
    fn write(&self, py: Python<'_>, name: Text, data: &Bound<'_, PyAny>) -> PyResult<()> {
        let name = name.get(py, "name")?;
        self.check_fork()?;
        let writer = &self.writer;
        let i = writer.layout.index_of(name).ok_or_else(|| {
            err(
                py,
                cuda_ipc::tensorset::TensorSetError::NoSuchTensor(format!("{name:?}")).into(),
            )
        })?;
        let raw = crate::args::raw_bytes(data)?;
        let dtype = writer.layout.tensors()[i].dtype;
        let element = dtype.size_bytes();
        if !raw.plain() && element != Some(raw.itemsize) {
            return Err(errors::invalid_argument(
                py,
                format!(
                    "tensor {name:?} has elements of {} ({dtype}); data has items of {} \
                     (format {:?}): write copies bytes as they are, never converting: convert \
                     the data to the tensor's dtype first, or give its plain bytes \
                     (memoryview(data).cast(\"B\")) to copy them as they are",
                    element.map_or("no whole number of bytes".to_string(), bytes),
                    bytes(raw.itemsize),
                    raw.format
                ),
            ));
        }
        let bytes = raw.bytes;
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
    /// update open (commit again, or abort). `NotSupported` in a forked child, which takes
    /// nothing: the parent's update stays open, the parent's to commit.
    #[pyo3(signature = (content=None, fingerprint=false))]
    pub(crate) fn commit(
        &self,
        py: Python<'_>,
        content: Option<&Bound<'_, PyAny>>,
        fingerprint: bool,
    ) -> PyResult<u64> {
        self.check_fork()?;
        if fingerprint && content.is_some() {
            return Err(errors::invalid_argument(
                py,
                "content and fingerprint=True: give one or the other".to_string(),
            ));
        }
        let content = crate::args::fingerprint_arg(py, "content", content)?;
        self.finish(py, content, fingerprint)
    }

    /// Gives the buffer back uncommitted (in place: the generation it held is gone and readers
    /// see nothing until the next commit). Aborting twice does nothing. `NotSupported` in a
    /// forked child: the buffer is the parent's to give back.
    pub(crate) fn abort(&self, py: Python<'_>) -> PyResult<()> {
        self.check_fork()?;
        let taken = lock(&self.update).take();
        if let Some(u) = taken {
            self.ended.store(true, Ordering::Relaxed);
            self.writer.give_back(py, u.into_writer());
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
        // The block's end commits or aborts: neither is a forked child's to do.
        self.check_fork()?;
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
        if self.writer.fork.inherited() {
            // Without the cell's lock, which a parent's thread may have held at the fork.
            return format!("TensorUpdate(of tensor set {:?}, forked)", self.writer.name);
        }
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
        if self.writer.fork.inherited() {
            // A forked child's copy: the update is the parent's. The cell is not locked (a
            // parent's thread may have held it at the fork) and the writer's state is not
            // touched; the Rust update and writer in the cell, dropped with it, act on nothing
            // of the parent's (`identity::fork`).
            return;
        }
        // Collected while open: give the writer back uncommitted, so the set stays usable.
        let taken = lock(&self.update).take();
        if let Some(u) = taken {
            Python::attach(|py| self.writer.give_back(py, u.into_writer()));
        }
    }
}
