//! The source tensors of `TensorUpdate.copy_from`, read from Python in bulk, merged into ranges
//! and enqueued.
//!
//! Each tensor's dtype, device, contiguity, size and data pointer are read by one `list(map(getter,
//! values))` per property over a chunk of tensors: one C-level loop per property (no bytecode,
//! no bound method per tensor), so a state dict of thousands of tensors costs about what
//! PyTorch's getters themselves cost. The dtype is compared by identity with the set's cached
//! `torch.dtype`; only a mismatch converts it (for the error's text).

use crate::errors;
use crate::tensors::{self, Torch};
use crate::util::err;
use cuda_ipc::tensorset::owned::OwnedUpdate;
use cuda_ipc::tensorset::{Layout, TensorSetError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyInt, PyList, PyString, PyTuple};

/// Tensors read per chunk at most: the copies of a chunk are enqueued before the next chunk is
/// read, so the GPU copies while the host reads on.
pub(crate) const CHUNK: usize = 512;

/// The fewest tensors of a chunk (but a last one of fewer left).
const FEWEST: usize = 64;

/// The length of the next chunk of sources, the previous one `prev` long (0 before the first),
/// `left` still to read: 64, then doubling up to [`CHUNK`], then at most half of what is left as
/// the end nears, and fewer than 128 left in one chunk. The first chunk's copies start after 64
/// reads, not 512, while the GPU has nothing to do; the last chunk's copies, which run after the
/// host is done, are short too. A chunk costs the host about 10 µs more than its reads.
pub(crate) fn next_chunk(prev: usize, left: usize) -> usize {
    if left < 2 * FEWEST {
        return left;
    }
    (prev * 2)
        .clamp(FEWEST, CHUNK)
        .min(left.div_ceil(2).max(FEWEST))
}

/// The name → index dict of `layout` (keys: the layout's name strings), for lookups by the
/// caller's `str` keys without converting them.
pub(crate) fn index_dict(
    py: Python<'_>,
    names: &Bound<'_, pyo3::types::PyTuple>,
) -> PyResult<Py<PyDict>> {
    let d = PyDict::new(py);
    for (i, n) in names.iter().enumerate() {
        d.set_item(n, i)?;
    }
    Ok(d.unbind())
}

/// One chunk of sources: `keys[k]` names `values[k]`.
pub(crate) struct Chunk<'py> {
    pub keys: Bound<'py, PyList>,
    pub values: Bound<'py, PyList>,
}

/// One source's copy: the set's tensor index, the source's address and bytes.
pub(crate) type Copy = (usize, u64, usize);

/// Reads the chunk's tensors: returns their copies in the chunk's order, and pushes what must
/// stay alive until the copies are ordered (contiguous copies made of non-contiguous sources)
/// onto `keep`; without `keep` (a copy plan), a non-contiguous source is refused. `device`: the
/// set's CUDA device, `None` for a host set. The properties are read with `__torch_function__`
/// off, so no Python code of the caller's (a tensor subclass's override, a `TorchFunctionMode`)
/// runs while earlier chunks' copies are enqueued.
///
/// # Errors
/// `TensorSetError::NoSuchTensor` for a name the set lacks; `InvalidArgument` for a value that
/// is not a tensor, another dtype or shape than the set's, a tensor on another kind of device
/// than the set's memory (a host set: CPU tensors; a GPU set: CUDA tensors), a tensor with no
/// memory, or a set tensor that is a strided view (an `over_tensors` set's: a copy of contiguous
/// bytes would scramble it). Nothing of the chunk is copied then.
pub(crate) fn read<'py>(
    py: Python<'py>,
    torch: &Torch,
    layout: &Layout,
    index: &Bound<'py, PyDict>,
    chunk: &Chunk<'py>,
    device: Option<i32>,
    keep: Option<&mut Vec<Bound<'py, PyAny>>>,
) -> PyResult<Vec<Copy>> {
    let idx = names(py, torch, layout, index, chunk)?;
    let values = &chunk.values;
    torch.without_torch_function(py, || {
        read_tensors(py, torch, layout, &idx, values, device, keep)
    })
}

/// The set's index of each key of `chunk`, after checking that each value is a `torch.Tensor`:
/// the checks of [`read`] that need no tensor property, which `TensorSetWriter.publish` makes
/// over all of its sources before it takes a buffer.
///
/// # Errors
/// `TensorSetError::NoSuchTensor` for a name the set lacks; `InvalidArgument` for a value that
/// is not a tensor.
pub(crate) fn names<'py>(
    py: Python<'py>,
    torch: &Torch,
    layout: &Layout,
    index: &Bound<'py, PyDict>,
    chunk: &Chunk<'py>,
) -> PyResult<Vec<usize>> {
    let mut idx = Vec::with_capacity(chunk.keys.len());
    for k in chunk.keys.iter() {
        // Looked up as a plain `str` (a subclass's text copied out), so that no `__hash__` or
        // `__eq__` of the caller's runs; names are strings, so any other key names no tensor.
        let (found, shown) = match k.cast::<PyString>() {
            Ok(s) => {
                // A lone surrogate is `InvalidArgument` naming the tensor name (`args::Text`).
                let text = s
                    .extract::<crate::args::Text>()?
                    .into_string(py, "tensor name")?;
                let found = if s.is_exact_instance_of::<PyString>() {
                    index.get_item(s)?
                } else {
                    index.get_item(PyString::new(py, &text))?
                };
                (found, format!("{text:?}"))
            }
            Err(_) if k.is_exact_instance_of::<PyInt>() => (None, k.to_string()),
            Err(_) => (None, format!("a key of type {}", k.get_type().name()?)),
        };
        match found {
            Some(i) => idx.push(i.extract::<usize>()?),
            None => {
                return Err(crate::util::err(
                    py,
                    TensorSetError::NoSuchTensor(shown).into(),
                ));
            }
        }
    }
    for (k, v) in chunk.values.iter().enumerate() {
        if !torch.is_tensor(py, &v) {
            let ty = v
                .get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_else(|_| "?".into());
            return Err(errors::invalid_argument(
                py,
                format!(
                    "tensor {:?}: a {ty} is not a torch.Tensor",
                    layout.tensors()[idx[k]].name
                ),
            ));
        }
    }
    Ok(idx)
}

/// [`read`] of tensors (each value a `torch.Tensor`), `idx[k]` the set's index of `values[k]`,
/// with `__torch_function__` off.
fn read_tensors<'py>(
    py: Python<'py>,
    torch: &Torch,
    layout: &Layout,
    idx: &[usize],
    values: &Bound<'py, PyList>,
    device: Option<i32>,
    mut keep: Option<&mut Vec<Bound<'py, PyAny>>>,
) -> PyResult<Vec<Copy>> {
    let n = values.len();
    let name = |k: usize| layout.tensors()[idx[k]].name.as_str();
    let dtypes = torch.map_list(py, &torch.get_dtype, values.as_any())?;
    for (k, dt) in dtypes.iter().enumerate() {
        let want = layout.tensors()[idx[k]].dtype;
        if dt.is(torch.dtype(py, want)?) {
            continue;
        }
        let got = tensors::dtype_arg(py, &dt)?;
        return Err(errors::invalid_argument(
            py,
            format!("tensor {:?}: dtype {got}, the set holds {want}", name(k)),
        ));
    }
    if let Some(d) = device {
        // The index of each source's device (-1 on the CPU): a GPU set copies from CUDA tensors
        // of its own device (its copies are ordered with PyTorch's work on that device only).
        // What a source's memory is, `Update::copy_many` asks the driver.
        let devices = torch.map_list(py, &torch.get_device, values.as_any())?;
        for (k, dev) in devices.iter().enumerate() {
            let dev: i64 = dev.extract()?;
            if dev < 0 {
                return Err(errors::invalid_argument(
                    py,
                    format!(
                        "tensor {:?} is not a CUDA tensor: a GPU tensor set copies from CUDA \
                         tensors",
                        name(k)
                    ),
                ));
            }
            if dev != i64::from(d) {
                return Err(errors::invalid_argument(
                    py,
                    format!(
                        "tensor {:?} is on device {dev}, the set on device {d}: copy it to the \
                         set's device first (an update orders its copies with PyTorch's work on \
                         the set's device only)",
                        name(k)
                    ),
                ));
            }
        }
    } else {
        let cpu = torch.map_list(py, &torch.get_is_cpu, values.as_any())?;
        for (k, c) in cpu.iter().enumerate() {
            if !c.is_truthy()? {
                return Err(errors::invalid_argument(
                    py,
                    format!(
                        "tensor {:?} is not on the CPU: a host tensor set copies from CPU tensors",
                        name(k)
                    ),
                ));
            }
        }
    }
    let contiguous = torch.map_list(py, &torch.is_contiguous, values.as_any())?;
    for (k, c) in contiguous.iter().enumerate() {
        if !c.is_truthy()? {
            let Some(keep) = keep.as_deref_mut() else {
                return Err(errors::invalid_argument(
                    py,
                    format!(
                        "tensor {:?} is not contiguous: a copy plan reads its sources' memory at \
                         every update, so a contiguous copy made now would go stale; pass \
                         contiguous tensors",
                        name(k)
                    ),
                ));
            };
            let t = torch.contiguous.bind(py).call1((values.get_item(k)?,))?;
            values.set_item(k, &t)?;
            keep.push(t);
        }
    }
    // The set's dtype (checked above) and shape make the bytes: a source of another shape is
    // refused even where its bytes would fit, as `load_state_dict` refuses a size mismatch (a
    // transposed weight, another model's config), never copied as bytes.
    let shapes = torch.map_list(py, &torch.get_shape, values.as_any())?;
    let ptrs = torch.map_list(py, &torch.data_ptr, values.as_any())?;
    let mut out = Vec::with_capacity(n);
    for (k, (shape, p)) in shapes.iter().zip(ptrs.iter()).enumerate() {
        let info = &layout.tensors()[idx[k]];
        if !same_shape(&shape, &info.shape)? {
            return Err(errors::invalid_argument(
                py,
                format!(
                    "tensor {:?}: shape {:?} given, the set's tensor has shape {:?}",
                    name(k),
                    shape.extract::<Vec<i64>>()?,
                    info.shape
                ),
            ));
        }
        if !is_contiguous(&info.shape, &info.strides) {
            return Err(errors::invalid_argument(
                py,
                format!(
                    "tensor {:?} is a strided view in the set (strides {:?}), which a copy of \
                     contiguous bytes would scramble: update it in place, through the set's own \
                     tensor (`TensorUpdate.tensors()`)",
                    name(k),
                    info.strides
                ),
            ));
        }
        let nb = info.bytes;
        let p: u64 = p.extract()?;
        if p == 0 && nb > 0 {
            return Err(errors::invalid_argument(
                py,
                format!(
                    "tensor {:?} has no memory (data_ptr() is 0: its storage was freed or \
                     resized to 0)",
                    name(k)
                ),
            ));
        }
        out.push((idx[k], p, nb as usize));
    }
    Ok(out)
}

/// Whether `shape` (a `torch.Size`, a tuple of ints) is `want`.
fn same_shape(shape: &Bound<'_, PyAny>, want: &[i64]) -> PyResult<bool> {
    let t = shape.cast::<PyTuple>()?;
    if t.len() != want.len() {
        return Ok(false);
    }
    for (d, w) in t.iter().zip(want) {
        if d.extract::<i64>()? != *w {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Whether a tensor of `shape` and `strides` (in elements) lies contiguously, row-major, as
/// `torch.Tensor.is_contiguous` says: dimensions of extent 1 may have any stride, and an empty
/// tensor is contiguous.
fn is_contiguous(shape: &[i64], strides: &[i64]) -> bool {
    if shape.contains(&0) {
        return true;
    }
    let mut expected = 1i64;
    for (&d, &s) in shape.iter().zip(strides).rev() {
        if d != 1 {
            if s != expected {
                return false;
            }
            expected = expected.saturating_mul(d);
        }
    }
    true
}

/// Enqueues `ranges` by `Update::copy_many` (`check`: the driver asked what each source's memory
/// is) or `Update::copy_many_unchecked`.
///
/// # Safety
/// 1. Every source is contiguous CUDA memory of its range's bytes on the set's device, kept
///    allocated until the copies are ordered before PyTorch's next use of it
///    (`TensorUpdate::ordered`).
/// 2. Without `check`, every source was checked before and stayed allocated since.
/// 3. The destinations are distinct tensors of the set (one dict key each); a source that is a
///    view of this update's buffer itself overlaps only its own destination or gives unspecified
///    bytes (documented), never memory outside the buffer.
pub(crate) unsafe fn copy_gpu(
    py: Python<'_>,
    u: &mut OwnedUpdate,
    ranges: &Ranges,
    check: bool,
) -> PyResult<()> {
    // SAFETY: this function's contract is `copy_many`'s, and `copy_many_unchecked`'s without
    // `check`.
    let r = unsafe {
        if check {
            u.update().copy_many(ranges)
        } else {
            u.update().copy_many_unchecked(ranges)
        }
    };
    r.map_err(|e| err(py, e))
}

/// Copies `(allocation, offset, source address, bytes)`.
pub(crate) type Ranges = Vec<(usize, u64, u64, usize)>;

/// The copies `(tensor, source address, bytes)` as copies `(allocation, offset, source, bytes)`,
/// each run of tensors that lie back to back both in the set and in the sources (a state dict
/// whose tensors are views of one flat buffer, in the set's order) merged into one copy: exactly
/// the same bytes land, with one driver call per run instead of one per tensor.
pub(crate) fn coalesce<'c>(layout: &Layout, copies: impl Iterator<Item = &'c Copy>) -> Ranges {
    let mut out: Vec<(usize, u64, u64, usize)> = Vec::new();
    for &(i, src, n) in copies {
        let t = &layout.tensors()[i];
        let (a, off) = (t.allocation as usize, t.offset);
        if let Some(last) = out.last_mut()
            && last.0 == a
            && last.1 + last.3 as u64 == off
            && last.2 + last.3 as u64 == src
        {
            last.3 += n;
            continue;
        }
        out.push((a, off, src, n));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunks(n: usize) -> Vec<usize> {
        let (mut out, mut done) = (Vec::new(), 0);
        while done < n {
            let k = next_chunk(out.last().copied().unwrap_or(0), n - done);
            assert!(k > 0);
            out.push(k);
            done += k;
        }
        out
    }

    #[test]
    fn contiguity_is_pytorchs_rule() {
        assert!(is_contiguous(&[4, 6], &[6, 1]));
        assert!(!is_contiguous(&[6, 4], &[1, 6])); // a transposed view
        assert!(!is_contiguous(&[4], &[2])); // every other element
        assert!(is_contiguous(&[1, 6], &[99, 1])); // extent 1: any stride
        assert!(is_contiguous(&[0, 6], &[1, 1])); // empty
        assert!(is_contiguous(&[], &[])); // 0-d
    }

    #[test]
    fn chunks_grow_from_64_to_512_and_shrink_towards_the_end() {
        assert_eq!(
            chunks(4608),
            vec![
                64, 128, 256, 512, 512, 512, 512, 512, 512, 512, 288, 144, 72, 72
            ]
        );
        assert_eq!(chunks(291), vec![64, 114, 113]);
        assert_eq!(chunks(64), vec![64]);
        assert_eq!(chunks(127), vec![127]);
        assert_eq!(chunks(128), vec![64, 64]);
        assert_eq!(chunks(1), vec![1]);
        assert!(chunks(0).is_empty());
        for n in [100, 1000, 20_000, 100_000] {
            let c = chunks(n);
            assert_eq!(c.iter().sum::<usize>(), n);
            assert!(c.iter().all(|&k| k <= CHUNK));
        }
    }
}
