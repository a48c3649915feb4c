//! `CopyPlan`: the sources of a GPU tensor set's updates read and checked once
//! (`TensorSetWriter.copy_plan`), for a writer that copies from the same tensors every step (a
//! trainer's parameters into the set its engines read).
//!
//! `TensorUpdate.copy_from(dict)` reads five properties of every source at every update (about
//! 0.7 µs a tensor: 3.1 ms of a 4,608-tensor update whose copies take 2.3 ms). A plan keeps what
//! they gave (the merged ranges) and the tensors themselves (so their memory stays allocated);
//! `copy_from(plan)` reads only each source's `data_ptr()` again, one bulk pass, and refuses the
//! update if any moved (a `set_`, `resize_` or reassigned storage since the plan), before anything
//! is copied: a stale address never reaches the copy kernel, which checks none.

use crate::errors;
use crate::sources::{self, Chunk};
use crate::sources::{Ranges, coalesce};
use crate::tensor_set_writer::TensorSetWriter;
use crate::tensors::Torch;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

/// A GPU tensor set's update sources, read and checked once (see the module's documentation).
#[pyclass(module = "cuda_ipc", frozen)]
pub(crate) struct CopyPlan {
    /// The writer it was made for: its layout's offsets are in `here` and `peer`.
    pub(crate) writer: Py<TensorSetWriter>,
    /// The sources, kept alive while the plan is; `ptrs[k]` and `idx[k]` are `values[k]`'s.
    pub(crate) values: Py<PyList>,
    pub(crate) ptrs: Vec<u64>,
    pub(crate) idx: Vec<usize>,
    /// The merged copies `(allocation, offset, source, bytes)` of sources on the set's device,
    /// and of sources on another device.
    pub(crate) here: Ranges,
    pub(crate) peer: Ranges,
}

/// Reads and checks `tensors` for updates of `writer`'s set.
///
/// # Errors
/// `InvalidArgument` for a host set, and as `copy_from` for a bad source, or a non-contiguous one.
pub(crate) fn make(
    writer: &Bound<'_, TensorSetWriter>,
    py: Python<'_>,
    tensors: &Bound<'_, PyDict>,
) -> PyResult<CopyPlan> {
    let w = writer.get();
    if w.host {
        return Err(errors::invalid_argument(
            py,
            "a copy plan is for GPU tensor sets; a host set's copy_from reads CPU tensors".into(),
        ));
    }
    let torch = Torch::get(py)?;
    let layout = &w.layout;
    let index = w.index(py)?;
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
            Some(w.device),
            None,
        )?);
    }
    Ok(CopyPlan {
        writer: writer.clone().unbind(),
        values: values.unbind(),
        ptrs: copies.iter().map(|c| c.1).collect(),
        idx: copies.iter().map(|c| c.0).collect(),
        here: coalesce(layout, copies.iter().filter(|c| c.3)),
        peer: coalesce(layout, copies.iter().filter(|c| !c.3)),
    })
}

impl CopyPlan {
    /// Checks that this plan is `writer`'s and that no source moved since it was made (one bulk
    /// `data_ptr()` pass over the sources).
    ///
    /// # Errors
    /// `InvalidArgument` naming the first source that moved, or for another writer's plan.
    pub(crate) fn check(&self, py: Python<'_>, writer: &Py<TensorSetWriter>) -> PyResult<()> {
        if !self.writer.is(writer) {
            return Err(errors::invalid_argument(
                py,
                "this copy plan was made for another tensor set writer".into(),
            ));
        }
        let torch = Torch::get(py)?;
        let ptrs = torch.map_list(py, &torch.data_ptr, self.values.bind(py).as_any())?;
        for (k, p) in ptrs.iter().enumerate() {
            if p.extract::<u64>()? != self.ptrs[k] {
                let name = &self.writer.get().layout.tensors()[self.idx[k]].name;
                return Err(errors::invalid_argument(
                    py,
                    format!(
                        "the source of tensor {name:?} moved since the copy plan was made (its \
                         data_ptr() changed): make a new plan"
                    ),
                ));
            }
        }
        Ok(())
    }
}

#[pymethods]
impl CopyPlan {
    /// The number of source tensors.
    #[getter]
    fn tensors(&self) -> usize {
        self.ptrs.len()
    }

    /// The number of copies an update makes (sources back to back both in the set and in memory
    /// merged into one).
    #[getter]
    fn ranges(&self) -> usize {
        self.here.len() + self.peer.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "CopyPlan(tensors={}, ranges={})",
            self.ptrs.len(),
            self.here.len() + self.peer.len()
        )
    }
}
