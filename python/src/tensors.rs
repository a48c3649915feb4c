//! Tensor sets as PyTorch tensors: dtypes both ways, specs from Python values, and the
//! `dict[str, torch.Tensor]` of one buffer built by the fastest honest route.
//!
//! The route: one `torch.from_dlpack` base (`uint8`, the whole allocation) per allocation, one
//! `view(dtype)` of it per dtype, then per tensor `torch.as_strided(shape, strides,
//! storage_offset)`; a run of consecutive tensors of one dtype, shape and strides at a constant
//! byte step (the experts of a MoE layer) is made by one `as_strided` of the stacked shape and
//! `unbind(0)`, a single call for the whole run. Nothing is copied; the tensors alias the
//! mappings, which live as long as the reader (the bases hold it) or the writer.

use crate::dlpack::{Export, Hold};
use crate::errors;
use cuda_ipc::tensorset::{DType, Layout, TensorInfo, TensorSpec};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};
use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// PyTorch's name of each DLPack dtype a tensor set can hold.
const TORCH_DTYPES: &[(DType, &str)] = &[
    (DType::F32, "float32"),
    (DType::F16, "float16"),
    (DType::BF16, "bfloat16"),
    (DType::F64, "float64"),
    (DType::I8, "int8"),
    (DType::I16, "int16"),
    (DType::I32, "int32"),
    (DType::I64, "int64"),
    (DType::U8, "uint8"),
    (DType::U16, "uint16"),
    (DType::U32, "uint32"),
    (DType::U64, "uint64"),
    (DType::BOOL, "bool"),
    (DType::C64, "complex64"),
    (DType::C128, "complex128"),
    (DType::F8_E4M3FN, "float8_e4m3fn"),
    (DType::F8_E4M3FNUZ, "float8_e4m3fnuz"),
    (DType::F8_E5M2, "float8_e5m2"),
    (DType::F8_E5M2FNUZ, "float8_e5m2fnuz"),
    (DType::F8_E8M0FNU, "float8_e8m0fnu"),
];

/// The DLPack dtype of `d`: a `torch.dtype`, or its name (`"bfloat16"`, `"torch.float8_e4m3fn"`).
pub(crate) fn dtype_arg(py: Python<'_>, d: &Bound<'_, PyAny>) -> PyResult<DType> {
    let text = match d.extract::<String>() {
        Ok(s) => s,
        Err(_) => d.str()?.to_string(),
    };
    let name = text.strip_prefix("torch.").unwrap_or(&text);
    let name = match name {
        "float" => "float32",
        "half" => "float16",
        "double" => "float64",
        "int" => "int32",
        "long" => "int64",
        "short" => "int16",
        n => n,
    };
    TORCH_DTYPES
        .iter()
        .find(|(_, n)| *n == name)
        .map(|(d, _)| *d)
        .ok_or_else(|| {
            errors::invalid_argument(
                py,
                format!("dtype {text:?} cannot be held in a tensor set (use a torch dtype such as torch.bfloat16)"),
            )
        })
}

/// PyTorch's name of `d`, or `NotSupported`.
fn torch_name(d: DType) -> PyResult<&'static str> {
    TORCH_DTYPES
        .iter()
        .find(|(x, _)| *x == d)
        .map(|(_, n)| *n)
        .ok_or_else(|| errors::not_supported(&format!("no PyTorch dtype for DLPack dtype {d:?}")))
}

/// The tensor specs of `tensors` (a dict of name → `torch.Tensor`, or name → `(shape, dtype)`),
/// in the dict's order; tensors are laid out contiguous whatever their strides.
pub(crate) fn specs_arg(py: Python<'_>, tensors: &Bound<'_, PyDict>) -> PyResult<Vec<TensorSpec>> {
    let mut out = Vec::with_capacity(tensors.len());
    for (k, v) in tensors.iter() {
        let name: String = k
            .extract()
            .map_err(|_| errors::invalid_argument(py, "tensor names must be str".to_string()))?;
        let (shape, dtype) = if v.hasattr("data_ptr")? && v.hasattr("dtype")? {
            let shape: Vec<i64> = v.getattr("shape")?.extract()?;
            (shape, dtype_arg(py, &v.getattr("dtype")?)?)
        } else {
            let (shape, dtype): (Bound<'_, PyAny>, Bound<'_, PyAny>) =
                v.extract().map_err(|_| {
                    errors::invalid_argument(
                        py,
                        format!("tensor {name:?}: give a torch.Tensor or a (shape, dtype) pair"),
                    )
                })?;
            let shape: Vec<i64> = match shape.extract::<i64>() {
                Ok(n) => vec![n],
                Err(_) => shape.extract().map_err(|_| {
                    errors::invalid_argument(
                        py,
                        format!(
                            "tensor {name:?}: the shape must be an int or a sequence of ints                              that fit in 64 bits"
                        ),
                    )
                })?,
            };
            (shape, dtype_arg(py, &dtype)?)
        };
        out.push(TensorSpec::new(name, dtype, &shape));
    }
    Ok(out)
}

/// Tensors made by one call: `members` (tensor indices, by rising offset) `step` bytes apart.
struct Run {
    members: Vec<usize>,
    step: u64,
}

/// The tensors grouped into runs: tensors of one allocation, dtype, shape and strides whose
/// offsets rise by a constant step that is a whole number of elements (the experts of a MoE
/// layer; the same projection of every layer of a transformer, a layer's bytes apart), each run
/// as long as the offsets keep that step; a tensor alone is a run of one.
fn runs(tensors: &[TensorInfo]) -> Vec<Run> {
    type Key<'a> = (u32, DType, &'a [i64], &'a [i64]);
    let mut groups: HashMap<Key<'_>, Vec<usize>> = HashMap::new();
    let mut order: Vec<Key<'_>> = Vec::new();
    for (i, t) in tensors.iter().enumerate() {
        let k = (
            t.allocation,
            t.dtype,
            t.shape.as_slice(),
            t.strides.as_slice(),
        );
        groups
            .entry(k)
            .or_insert_with(|| {
                order.push(k);
                Vec::new()
            })
            .push(i);
    }
    let mut out = Vec::new();
    for k in order {
        let mut g = groups.remove(&k).unwrap_or_default();
        g.sort_by_key(|&i| tensors[i].offset);
        let size = k.1.size_bytes().unwrap_or(0) as u64;
        let mut at = 0;
        while at < g.len() {
            let mut run = Run {
                members: vec![g[at]],
                step: 0,
            };
            if size > 0 && at + 1 < g.len() {
                let step = tensors[g[at + 1]].offset - tensors[g[at]].offset;
                if step > 0 && step.is_multiple_of(size) {
                    run.step = step;
                    let mut j = at + 1;
                    while j < g.len() && tensors[g[j]].offset - tensors[g[j - 1]].offset == step {
                        run.members.push(g[j]);
                        j += 1;
                    }
                }
            }
            at += run.members.len();
            out.push(run);
        }
    }
    out
}

/// One allocation's base tensor and its typed views.
struct Base<'py> {
    bytes: Bound<'py, PyAny>,
    typed: HashMap<DType, Bound<'py, PyAny>>,
}

/// Builds the tensors of one buffer: `bases[a]` is allocation `a`'s device address and length
/// (`None` when no tensor lies there), `device` the CUDA ordinal, `owner` what the bases keep
/// alive (the reader; `None` for a writer's buffer, valid while the writer lives).
pub(crate) fn build<'py>(
    py: Python<'py>,
    layout: &Layout,
    bases: &[Option<(u64, usize)>],
    device: i32,
    owner: Option<Arc<dyn Any + Send + Sync>>,
) -> PyResult<Bound<'py, PyDict>> {
    let torch = py.import("torch")?;
    let from_dlpack = torch.getattr("from_dlpack")?;
    let as_strided = torch.getattr("as_strided")?;
    let mut made: Vec<Option<Base<'py>>> = Vec::with_capacity(bases.len());
    for b in bases {
        let Some((ptr, len)) = *b else {
            made.push(None);
            continue;
        };
        let export = Export {
            hold: match &owner {
                Some(o) => Hold::Owner(o.clone()),
                None => Hold::None,
            },
            ptr,
            nbytes: len,
            device,
            ready_on: 0,
            frame: None,
            target: Mutex::new(None),
        };
        // `stream=-1`: no ordering here; the caller orders the tensors' stream with the
        // generation's (`Held::ready_on_raw`).
        let capsule = export.export(
            py,
            Some(&(-1i64).into_pyobject(py)?.into_any()),
            None,
            None,
            None,
        )?;
        let bytes = from_dlpack.call1((capsule,))?;
        made.push(Some(Base {
            bytes,
            typed: HashMap::new(),
        }));
    }
    let tensors = layout.tensors();
    let mut made_tensors: Vec<Option<Bound<'py, PyAny>>> = vec![None; tensors.len()];
    for run in runs(tensors) {
        let t = &tensors[run.members[0]];
        let size =
            t.dtype.size_bytes().ok_or_else(|| {
                errors::not_supported(&format!("tensor {:?}: sub-byte dtype", t.name))
            })? as u64;
        let base = made
            .get_mut(t.allocation as usize)
            .and_then(Option::as_mut)
            .ok_or_else(|| errors::not_supported("a tensor outside the set's allocations"))?;
        let typed = match base.typed.get(&t.dtype) {
            Some(v) => v.clone(),
            None => {
                let n = base.bytes.call_method0("numel")?.extract::<u64>()?;
                let whole = n - n % size;
                let dt = torch.getattr(torch_name(t.dtype)?)?;
                let v = base
                    .bytes
                    .call_method1("narrow", (0, 0, whole))?
                    .call_method1("view", (dt,))?;
                base.typed.insert(t.dtype, v.clone());
                v
            }
        };
        if !t.offset.is_multiple_of(size) {
            return Err(errors::not_supported(&format!(
                "tensor {:?} starts at byte {}, not a whole number of {size}-byte elements",
                t.name, t.offset
            )));
        }
        let offset = t.offset / size;
        if run.members.len() == 1 {
            let v = as_strided.call1((
                &typed,
                PyTuple::new(py, &t.shape)?,
                PyTuple::new(py, &t.strides)?,
                offset,
            ))?;
            made_tensors[run.members[0]] = Some(v);
        } else {
            let mut shape = vec![run.members.len() as i64];
            shape.extend_from_slice(&t.shape);
            let mut strides = vec![(run.step / size) as i64];
            strides.extend_from_slice(&t.strides);
            let stacked = as_strided.call1((
                &typed,
                PyTuple::new(py, &shape)?,
                PyTuple::new(py, &strides)?,
                offset,
            ))?;
            let parts = stacked.call_method1("unbind", (0,))?;
            let parts = parts.cast::<PyTuple>()?;
            for (k, v) in parts.iter().enumerate() {
                made_tensors[run.members[k]] = Some(v);
            }
        }
    }
    let d = PyDict::new(py);
    for (t, v) in tensors.iter().zip(made_tensors) {
        d.set_item(&t.name, v)?;
    }
    Ok(d)
}

/// The device address and length of each allocation of one buffer, from where its tensors lie:
/// `ptr(i)` is tensor `i`'s address in that buffer.
pub(crate) fn allocation_bases(
    layout: &Layout,
    mut ptr: impl FnMut(usize) -> cuda_ipc::Result<u64>,
) -> cuda_ipc::Result<Vec<Option<(u64, usize)>>> {
    let mut out = vec![None; layout.allocations().len()];
    for (i, t) in layout.tensors().iter().enumerate() {
        let a = t.allocation as usize;
        if out[a].is_none() {
            let base = ptr(i)? - t.offset;
            out[a] = Some((base, layout.allocations()[a] as usize));
        }
    }
    Ok(out)
}

/// The names of a layout's tensors, as a list.
pub(crate) fn names<'py>(py: Python<'py>, layout: &Layout) -> PyResult<Bound<'py, PyList>> {
    PyList::new(py, layout.tensors().iter().map(|t| t.name.as_str()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(name: &str, shape: &[i64], offset: u64) -> TensorInfo {
        let strides = match shape.len() {
            2 => vec![shape[1], 1],
            1 => vec![1],
            _ => vec![],
        };
        TensorInfo {
            name: name.into(),
            dtype: DType::BF16,
            shape: shape.to_vec(),
            strides,
            allocation: 0,
            offset,
            bytes: 0,
        }
    }

    fn members(r: &[Run]) -> Vec<Vec<usize>> {
        r.iter().map(|r| r.members.clone()).collect()
    }

    #[test]
    fn equal_tensors_at_a_constant_step_form_one_run() {
        let t: Vec<_> = (0..5)
            .map(|i| info(&format!("e{i}"), &[4, 8], i * 256))
            .collect();
        let r = runs(&t);
        assert_eq!(members(&r), vec![vec![0, 1, 2, 3, 4]]);
        assert_eq!(r[0].step, 256);
    }

    #[test]
    fn the_same_tensor_of_every_layer_forms_one_run_across_the_others() {
        // Layers of [q (4x8), norm (8)], each layer 512 bytes: the q's form one run, the norms one.
        let mut t = Vec::new();
        for l in 0..4u64 {
            t.push(info(&format!("l{l}.q"), &[4, 8], l * 512));
            t.push(info(&format!("l{l}.norm"), &[8], l * 512 + 256));
        }
        let r = runs(&t);
        assert_eq!(members(&r), vec![vec![0, 2, 4, 6], vec![1, 3, 5, 7]]);
        assert!(r.iter().all(|r| r.step == 512));
    }

    #[test]
    fn a_broken_step_starts_a_new_run_and_every_tensor_is_in_exactly_one() {
        let t = vec![
            info("a", &[4, 8], 0),
            info("b", &[4, 8], 256),
            info("c", &[4, 8], 768),
            info("d", &[8], 1024),
            info("e", &[4, 8], 1280),
        ];
        let r = runs(&t);
        assert_eq!(members(&r), vec![vec![0, 1], vec![2, 4], vec![3]]);
        let mut all: Vec<usize> = r.iter().flat_map(|r| r.members.clone()).collect();
        all.sort();
        assert_eq!(all, vec![0, 1, 2, 3, 4]);
    }
}
