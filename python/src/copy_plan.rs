//! `CopyPlan`: the sources of a GPU tensor set's updates read and checked once
//! (`TensorSetWriter.copy_plan`), for a writer that copies from the same tensors every step (a
//! trainer's parameters into the set its engines read).
//!
//! `TensorUpdate.copy_from(dict)` reads five properties of every source at every update (about
//! 0.6 µs a tensor: 2.4–3.8 ms of a 4,608-tensor update whose copies take 2.3 ms) and has the
//! driver say what each source's memory is. A plan keeps what they gave (the merged ranges), the
//! tensors and their storages (so that a storage replaced by another cannot free its memory and
//! hand its address to the new one). Its first update has the driver check the sources; every
//! update reads each source's `data_ptr()` again, in bulk, [`CHUNK`] sources at a time, and
//! refuses the update if any moved (a parameter given a new storage: `p.data = ...`, `set_`, a
//! `resize_` that reallocates, or frees: `data_ptr()` 0) before anything of that source's chunk
//! is copied, so a stale address never reaches the copy kernel. The chunks before it may be
//! copied by then (the update stays open and uncommitted, as after any failed `copy_from`): each
//! chunk's copies are enqueued as soon as its pointers are read, so the GPU starts copying after
//! the first chunk's pass (about 20 µs) instead of after all of them (0.2–0.5 ms for 4,608
//! sources). Not seen: a storage resized in place to fewer bytes at the same address
//! (`resize_(0)` then a smaller `resize_` that lands there again); make a new plan after
//! resizing a source's storage.

use crate::errors;
use crate::sources::{self, Chunk, Ranges, coalesce};
use crate::tensors::Torch;
use cuda_ipc::tensorset::Layout;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// Sources whose pointers are read and whose copies are enqueued at a time: two launches of the
/// copy kernel (`cuda_ipc::tensorset::Update::copy_many`, 160 ranges each).
pub(crate) const CHUNK: usize = 320;

/// One chunk of a plan: its sources `values[start..end]` and their merged copies.
pub(crate) struct PlanChunk {
    start: usize,
    end: usize,
    /// The merged copies `(allocation, offset, source, bytes)` of the chunk's sources.
    pub(crate) ranges: Ranges,
}

/// A GPU tensor set's update sources, read and checked once (see the module's documentation).
#[pyclass(module = "cuda_ipc", frozen)]
pub(crate) struct CopyPlan {
    /// The layout of the writer it was made for (its offsets are in `ranges`): the writer's own
    /// `Arc`, compared by address, so the plan holds no reference to the writer.
    layout: Arc<Layout>,
    /// The sources and their storages, kept alive while the plan is; `ptrs[k]` and `idx[k]` are
    /// `values[k]`'s.
    values: Py<PyList>,
    _storages: Py<PyList>,
    ptrs: Vec<u64>,
    idx: Vec<usize>,
    /// The sources in chunks of [`CHUNK`], with their merged copies.
    pub(crate) chunks: Vec<PlanChunk>,
    /// Whether an update had the driver check the sources (`Update::copy_many`); later ones copy
    /// without (`copy_many_unchecked`). Set only after a check passed (Release; read Acquire
    /// by `needs_check`).
    checked: AtomicBool,
}

/// The writer a plan is made for: its set's layout (compared by address), its name → index
/// dict, and its memory (`device`: the CUDA ordinal, `None` for a host set).
pub(crate) struct For<'a, 'py> {
    pub layout: &'a Arc<Layout>,
    pub index: &'a Bound<'py, PyDict>,
    pub device: Option<i32>,
}

/// Reads and checks `tensors` for updates of the set `w` describes.
///
/// # Errors
/// `InvalidArgument` for a host set, and as `copy_from` for a bad source, or a non-contiguous one.
pub(crate) fn make(
    w: For<'_, '_>,
    py: Python<'_>,
    tensors: &Bound<'_, PyDict>,
) -> PyResult<CopyPlan> {
    let Some(device) = w.device else {
        return Err(errors::invalid_argument(
            py,
            "a copy plan is for GPU tensor sets; a host set's copy_from reads CPU tensors".into(),
        ));
    };
    let torch = Torch::get(py)?;
    let (layout, index) = (w.layout, w.index);
    let keys = tensors.keys();
    let values = tensors.values();
    let mut copies = Vec::with_capacity(values.len());
    let mut at = 0;
    while at < keys.len() {
        let end = (at + sources::CHUNK).min(keys.len());
        let chunk = Chunk {
            keys: keys.get_slice(at, end),
            values: values.get_slice(at, end),
        };
        at = end;
        copies.extend(sources::read(
            py,
            torch,
            layout,
            index,
            &chunk,
            Some(device),
            None,
        )?);
    }
    let storages = torch.without_torch_function(py, || {
        torch.map_list(py, &torch.untyped_storage, values.as_any())
    })?;
    let chunks = (0..copies.len())
        .step_by(CHUNK)
        .map(|start| {
            let end = (start + CHUNK).min(copies.len());
            PlanChunk {
                start,
                end,
                ranges: coalesce(layout, copies[start..end].iter()),
            }
        })
        .collect();
    Ok(CopyPlan {
        layout: layout.clone(),
        values: values.unbind(),
        _storages: storages.unbind(),
        ptrs: copies.iter().map(|c| c.1).collect(),
        idx: copies.iter().map(|c| c.0).collect(),
        chunks,
        checked: AtomicBool::new(false),
    })
}

impl CopyPlan {
    /// Checks that this plan was made for the writer whose layout is `layout` (the writer's own
    /// `Arc`).
    ///
    /// # Errors
    /// `InvalidArgument` for another writer's plan.
    pub(crate) fn check_writer(&self, py: Python<'_>, layout: &Arc<Layout>) -> PyResult<()> {
        if Arc::ptr_eq(&self.layout, layout) {
            return Ok(());
        }
        Err(errors::invalid_argument(
            py,
            "this copy plan was made for another tensor set writer".into(),
        ))
    }

    /// Checks that no source of `chunk` moved since the plan was made (one bulk `data_ptr()`
    /// pass over them).
    ///
    /// # Errors
    /// `InvalidArgument` naming the first source of the chunk that moved.
    pub(crate) fn check_chunk(&self, py: Python<'_>, chunk: &PlanChunk) -> PyResult<()> {
        let torch = Torch::get(py)?;
        let values = self.values.bind(py).get_slice(chunk.start, chunk.end);
        // Without `__torch_function__`: no code of the caller's runs between the chunks'
        // enqueues (see `Torch::without_torch_function`).
        let ptrs = torch
            .without_torch_function(py, || torch.map_list(py, &torch.data_ptr, values.as_any()))?;
        for (j, p) in ptrs.iter().enumerate() {
            let k = chunk.start + j;
            let p: u64 = p.extract()?;
            if p != self.ptrs[k] {
                let name = &self.layout.tensors()[self.idx[k]].name;
                let what = if p == 0 {
                    "has no memory since the copy plan was made (data_ptr() is 0: its storage \
                     was freed or resized to 0)"
                } else {
                    "moved since the copy plan was made (its data_ptr() changed)"
                };
                return Err(errors::invalid_argument(
                    py,
                    format!("the source of tensor {name:?} {what}: make a new plan"),
                ));
            }
        }
        Ok(())
    }

    /// Whether the next update must have the driver check the sources.
    pub(crate) fn needs_check(&self) -> bool {
        // Acquire: pairs with the Release in `checked_now`.
        !self.checked.load(Ordering::Acquire)
    }

    /// Records that an update's check of the sources passed.
    pub(crate) fn checked_now(&self) {
        // Release: pairs with the Acquire in `needs_check`.
        self.checked.store(true, Ordering::Release);
    }
}

#[pymethods]
impl CopyPlan {
    /// The number of source tensors.
    fn __len__(&self) -> usize {
        self.ptrs.len()
    }

    /// The number of copies an update makes (sources back to back both in the set and in memory
    /// merged into one, within chunks of 320 sources).
    #[getter]
    fn ranges(&self) -> usize {
        self.chunks.iter().map(|c| c.ranges.len()).sum()
    }

    fn __repr__(&self) -> String {
        format!(
            "CopyPlan(sources={}, ranges={})",
            self.ptrs.len(),
            self.ranges()
        )
    }
}
