//! Tensor sets as PyTorch tensors: dtypes both ways, specs from Python values, and the
//! `dict[str, torch.Tensor]` of one buffer built by the fastest honest route.
//!
//! The route: one `torch.from_dlpack` base per allocation and dtype, exported as that dtype (for
//! bool, complex, the wider uints and fp8: one `uint8` base of the whole allocation and a
//! `view(dtype)` of it), then per tensor `torch.as_strided(shape, strides, storage_offset)`; a run of consecutive tensors of one dtype, shape and strides at a constant
//! byte step (the experts of a MoE layer) is made by one `as_strided` of the stacked shape and
//! `unbind(0)`, a single call for the whole run. Nothing is copied; the tensors alias the
//! mappings, which live as long as the reader (the bases hold it) or the writer.

use crate::args::Text;
use crate::dlpack::{Export, Hold};
use crate::errors;
use cuda_ipc::tensorset::{DType, Layout, TensorInfo, TensorSpec};
use dlpark::ffi::{DLDataType, DLDataTypeCode};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple, PyType};
use std::any::Any;
use std::collections::HashMap;
use std::sync::atomic::{AtomicPtr, Ordering};
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
    // A name given as a `str` with a lone surrogate is `InvalidArgument` naming the dtype
    // (`Text`), not a name spelled with replacement characters.
    let text = if d.is_instance_of::<PyString>() {
        d.extract::<Text>()?.into_string(py, "dtype")?
    } else {
        d.str()?.to_string()
    };
    let name = text.strip_prefix("torch.").unwrap_or(&text);
    let name = match name {
        "float" => "float32",
        "half" => "float16",
        "double" => "float64",
        "int" => "int32",
        "long" => "int64",
        "short" => "int16",
        "cfloat" => "complex64",
        "cdouble" => "complex128",
        n => n,
    };
    TORCH_DTYPES
        .iter()
        .find(|(_, n)| *n == name)
        .map(|(d, _)| *d)
        .ok_or_else(|| {
            if is_torch_dtype(py, d, name) {
                errors::not_supported(&format!(
                    "dtype {text:?} cannot be held in a tensor set (it has no DLPack code the set \
                     takes; supported: float32/16/64, bfloat16, the float8 kinds, int8/16/32/64, \
                     uint8/16/32/64, bool, complex64/128)"
                ))
            } else {
                errors::invalid_argument(
                    py,
                    format!("dtype {text:?} is not a dtype (use a torch dtype such as torch.bfloat16, or its name)"),
                )
            }
        })
}

/// Whether `d` is a `torch.dtype`, or names one (`"quint8"`), where PyTorch is imported already:
/// a dtype PyTorch has that a set cannot hold is `NotSupported`, anything else `InvalidArgument`.
fn is_torch_dtype(py: Python<'_>, d: &Bound<'_, PyAny>, name: &str) -> bool {
    let Ok(modules) = py.import("sys").and_then(|s| s.getattr("modules")) else {
        return false;
    };
    let Ok(torch) = modules.get_item("torch") else {
        return false;
    };
    let Ok(dtype) = torch.getattr("dtype") else {
        return false;
    };
    if d.is_instance(&dtype).unwrap_or(false) {
        return true;
    }
    torch
        .getattr(name)
        .and_then(|v| v.is_instance(&dtype))
        .unwrap_or(false)
}

/// The shape of tensor `name` given as an int or a sequence of ints, each fitting in 64 bits; a
/// `bool` (an `int` to Python: `True` is 1) is no dimension, as for every integer argument.
///
/// # Errors
/// `InvalidArgument` naming the tensor (as for every argument the library takes) for a shape that
/// is no int or sequence, a dimension that is no int (a float, a str, `None`; the type named), a
/// dimension past 64 bits, and the `bool` where one is given; what a dimension's own `__index__`
/// (or a sequence's `__len__`/`__getitem__`) raised, other than a `TypeError`, as it was.
fn shape_arg(py: Python<'_>, name: &str, shape: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    use pyo3::exceptions::{PyOverflowError, PyTypeError};
    let not_a = |what: &str, v: &Bound<'_, PyAny>| {
        errors::invalid_argument(py, format!("tensor {name:?}: {what}, got {}", type_of(v)))
    };
    let too_large = || {
        errors::invalid_argument(
            py,
            format!("tensor {name:?}: a shape's dimensions must fit in 64 bits"),
        )
    };
    let a_bool = |v: &Bound<'_, PyAny>| {
        errors::invalid_argument(
            py,
            format!(
                "tensor {name:?}: a shape's dimensions are ints, got a bool ({}): True and False \
                 are no dimensions",
                if v.is_truthy().unwrap_or(false) {
                    "True"
                } else {
                    "False"
                }
            ),
        )
    };
    let is_bool = |v: &Bound<'_, PyAny>| v.is_instance_of::<pyo3::types::PyBool>();
    // One dimension: an int (`__index__`); a type error says which type; an int past 64 bits is
    // a bad value; anything else its `__index__` raised goes up unchanged.
    let dim = |d: &Bound<'_, PyAny>| -> PyResult<i64> {
        if is_bool(d) {
            return Err(a_bool(d));
        }
        d.extract::<i64>().map_err(|e| {
            if e.is_instance_of::<PyOverflowError>(py) {
                too_large()
            } else if e.is_instance_of::<PyTypeError>(py) {
                not_a("a shape's dimensions are ints", d)
            } else {
                e
            }
        })
    };
    if is_bool(shape) {
        return Err(a_bool(shape));
    }
    if shape.is_instance_of::<pyo3::types::PyInt>() || shape.hasattr("__index__")? {
        return Ok(vec![dim(shape)?]);
    }
    if is_text(shape) {
        return Err(not_a(
            "the shape must be an int or a sequence of ints",
            shape,
        ));
    }
    let dims: Vec<Bound<'_, PyAny>> = shape.extract().map_err(|e: PyErr| {
        if e.is_instance_of::<PyTypeError>(py) {
            not_a("the shape must be an int or a sequence of ints", shape)
        } else {
            e
        }
    })?;
    dims.iter().map(dim).collect()
}

/// Whether `v` is a `str` or `bytes`: sequences, but never a shape or a (shape, dtype) pair
/// (`bytes` would read as its byte values).
fn is_text(v: &Bound<'_, PyAny>) -> bool {
    v.is_instance_of::<PyString>() || v.is_instance_of::<pyo3::types::PyBytes>()
}

/// The name of `v`'s type, for a message (`?` where even that fails).
fn type_of(v: &Bound<'_, PyAny>) -> String {
    v.get_type()
        .name()
        .map_or_else(|_| "?".to_string(), |n| n.to_string())
}

/// The name of a tensor given as a dict key: a `str` (`InvalidArgument` naming the type for
/// another; for a `str` that is no UTF-8, one with a lone surrogate, saying so).
pub(crate) fn tensor_name(py: Python<'_>, k: &Bound<'_, PyAny>) -> PyResult<String> {
    if !k.is_instance_of::<PyString>() {
        return Err(errors::invalid_argument(
            py,
            format!("tensor names must be str, got {}", type_of(k)),
        ));
    }
    k.extract::<Text>()?.into_string(py, "tensor name")
}

/// The tensor specs of `tensors` (a dict of name → `torch.Tensor`, or name → `(shape, dtype)`,
/// the pair any sequence of two), in the dict's order; tensors are laid out contiguous whatever
/// their strides. The dict's items are taken at once (`dict.items()`): a dimension's
/// `__index__` or a dtype's `__str__` that changes the dict changes nothing here.
///
/// # Errors
/// `InvalidArgument` for a name that is no `str`, a value that is neither a tensor nor a pair
/// (both naming the type given), an unknown dtype ([`dtype_arg`]), and as [`shape_arg`].
pub(crate) fn specs_arg(py: Python<'_>, tensors: &Bound<'_, PyDict>) -> PyResult<Vec<TensorSpec>> {
    let items = tensors.items();
    let mut out = Vec::with_capacity(items.len());
    for item in items.iter() {
        let (k, v): (Bound<'_, PyAny>, Bound<'_, PyAny>) = item.extract()?;
        let name = tensor_name(py, &k)?;
        let (shape, dtype) = if v.hasattr("data_ptr")? && v.hasattr("dtype")? {
            let shape: Vec<i64> = v.getattr("shape")?.extract()?;
            (shape, dtype_arg(py, &v.getattr("dtype")?)?)
        } else {
            let pair: Option<Vec<Bound<'_, PyAny>>> = if is_text(&v) {
                None
            } else {
                v.extract().ok().filter(|p: &Vec<_>| p.len() == 2)
            };
            let Some(pair) = pair else {
                return Err(errors::invalid_argument(
                    py,
                    format!(
                        "tensor {name:?}: give a torch.Tensor or a (shape, dtype) pair, got {}",
                        type_of(&v)
                    ),
                ));
            };
            (shape_arg(py, &name, &pair[0])?, dtype_arg(py, &pair[1])?)
        };
        out.push(TensorSpec::new(name, dtype, &shape));
    }
    Ok(out)
}

/// PyTorch's callables and dtype objects, looked up once per process: the first dict pays the
/// attribute lookups, later ones (and every `copy_from`) none.
pub(crate) struct Torch {
    pub from_dlpack: Py<PyAny>,
    pub as_strided: Py<PyAny>,
    /// `torch.Tensor.unbind`, `narrow`, `view`, `contiguous` (unbound: called with the tensor
    /// first).
    pub unbind: Py<PyAny>,
    pub narrow: Py<PyAny>,
    pub view: Py<PyAny>,
    pub contiguous: Py<PyAny>,
    /// `torch.Tensor.data_ptr`, `is_contiguous`, and getters of `shape`, `dtype`, `is_cpu`
    /// (`operator.attrgetter`), for `map` over many tensors.
    pub data_ptr: Py<PyAny>,
    pub is_contiguous: Py<PyAny>,
    pub get_shape: Py<PyAny>,
    pub get_dtype: Py<PyAny>,
    pub get_is_cpu: Py<PyAny>,
    /// `torch.Tensor.get_device` (unbound): the CUDA device's index, -1 for a CPU tensor.
    pub get_device: Py<PyAny>,
    /// `torch.Tensor.untyped_storage` (unbound).
    pub untyped_storage: Py<PyAny>,
    /// `builtins.map` and `builtins.list`.
    pub map: Py<PyAny>,
    pub list: Py<PyAny>,
    /// `torch.Tensor`.
    tensor: Py<PyType>,
    /// `torch._C.DisableTorchFunction`: no `__torch_function__` of a subclass or a mode runs
    /// while one is entered.
    disable_torch_function: Py<PyAny>,
    /// `torch.cuda.is_initialized`, `torch.cuda.current_stream`, and
    /// `torch._C._cuda_getCurrentRawStream` where this PyTorch has it (CUDA builds; what its
    /// compiled kernels ask for the current stream): see [`Torch::current_stream`].
    cuda_is_initialized: Py<PyAny>,
    cuda_current_stream: Py<PyAny>,
    raw_stream: Option<Py<PyAny>>,
    /// The `torch.dtype` of each entry of `TORCH_DTYPES` this PyTorch has.
    dtypes: Vec<Option<Py<PyAny>>>,
    /// The `torch` module all of these were looked up in.
    module: Py<PyAny>,
}

/// The process's [`Torch`], made from the `torch` module that was in `sys.modules` then (its
/// `module`): made again, and the old one left (never freed: a handful of references), when
/// `sys.modules["torch"]` is another module since (a stand-in that a test put there, then the real
/// one). Not a blocking once-cell: two threads may both make one (the last stored stays), a forked
/// child never waits for a making that its parent's other thread had under way, and a making
/// that PyTorch's own attribute lookups re-enter fails instead of waiting for itself ([`MAKING`]).
/// The store (`Release`) pairs with [`Torch::get`]'s load (`Acquire`): a thread that sees the
/// pointer sees the whole `Torch` it points to.
static TORCH: AtomicPtr<Torch> = AtomicPtr::new(std::ptr::null_mut());

thread_local! {
    /// Whether this thread is making a [`Torch`] (looking PyTorch's attributes up) now.
    static MAKING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

impl Torch {
    /// [`Torch::get`] for a call that needs PyTorch for `what` (`"tensors() makes torch.Tensor
    /// views"`, `"publish(dict) reads torch.Tensor sources"`): without it, one `ImportError`
    /// that says so, names the import's own error (its cause), and for a host set (`host`) names
    /// the methods that need no PyTorch (`TensorHold.read`, `TensorUpdate.write`).
    ///
    /// # Errors
    /// That `ImportError`; any other error of the import as it is.
    pub(crate) fn needed(py: Python<'_>, what: &str, host: bool) -> PyResult<&'static Torch> {
        Torch::get(py).map_err(|e| {
            if !e.is_instance_of::<pyo3::exceptions::PyImportError>(py) {
                return e;
            }
            let alternative = if host {
                "; a host set's bytes are also read with TensorHold.read(name) and written with \
                 TensorUpdate.write(name, data), without PyTorch"
            } else {
                ""
            };
            let clear = pyo3::exceptions::PyImportError::new_err(format!(
                "{what} and needs PyTorch, which did not import ({}){alternative}",
                e.value(py)
            ));
            clear.set_cause(py, Some(e));
            clear
        })
    }

    /// The process's `Torch`: imported at the first call, made again when `sys.modules["torch"]`
    /// is another module since ([`TORCH`]).
    ///
    /// # Errors
    /// `ImportError` when PyTorch is not installed, or when PyTorch's attribute lookups for it
    /// called back into a call that needs it (on the same thread); PyTorch's own errors as raised.
    pub(crate) fn get(py: Python<'_>) -> PyResult<&'static Torch> {
        // SAFETY: the GIL is held (`py`); `PyImport_GetModuleDict` returns a borrowed reference to
        // the interpreter's `sys.modules` (or null), which lives as long as the interpreter.
        let modules =
            unsafe { Bound::from_borrowed_ptr_or_opt(py, pyo3::ffi::PyImport_GetModuleDict()) };
        let now = modules.and_then(|m| m.get_item("torch").ok());
        let cached = TORCH.load(Ordering::Acquire);
        // SAFETY: a non-null pointer was stored from a `Box` that is never freed (below).
        if let Some(t) = unsafe { cached.as_ref() }
            && now.as_ref().is_some_and(|m| m.is(t.module.bind(py)))
        {
            return Ok(t);
        }
        if MAKING.get() {
            return Err(pyo3::exceptions::PyImportError::new_err(
                "PyTorch's attributes were asked for by a call that looking them up made \
                 (a torch attribute that calls back into cuda_ipc)",
            ));
        }
        MAKING.set(true);
        let made = Self::make(py);
        MAKING.set(false);
        let t: &'static Torch = Box::leak(Box::new(made?));
        TORCH.store(std::ptr::from_ref(t).cast_mut(), Ordering::Release);
        Ok(t)
    }

    /// A new `Torch` from the `torch` module (imported if it is not).
    fn make(py: Python<'_>) -> PyResult<Torch> {
        {
            let torch = py.import("torch")?;
            let tensor = torch.getattr("Tensor")?;
            let operator = py.import("operator")?;
            let builtins = py.import("builtins")?;
            let m = |o: &Bound<'_, PyAny>, n: &str| o.getattr(n).map(Bound::unbind);
            let get = |n: &str| operator.call_method1("attrgetter", (n,)).map(Bound::unbind);
            Ok(Torch {
                from_dlpack: m(&torch, "from_dlpack")?,
                as_strided: m(&torch, "as_strided")?,
                unbind: m(&tensor, "unbind")?,
                narrow: m(&tensor, "narrow")?,
                view: m(&tensor, "view")?,
                contiguous: m(&tensor, "contiguous")?,
                data_ptr: m(&tensor, "data_ptr")?,
                is_contiguous: m(&tensor, "is_contiguous")?,
                get_shape: get("shape")?,
                get_dtype: get("dtype")?,
                get_is_cpu: get("is_cpu")?,
                get_device: m(&tensor, "get_device")?,
                untyped_storage: m(&tensor, "untyped_storage")?,
                map: m(&builtins, "map")?,
                list: m(&builtins, "list")?,
                tensor: tensor.cast::<PyType>()?.clone().unbind(),
                disable_torch_function: m(&torch.getattr("_C")?, "DisableTorchFunction")?,
                cuda_is_initialized: m(&torch.getattr("cuda")?, "is_initialized")?,
                cuda_current_stream: m(&torch.getattr("cuda")?, "current_stream")?,
                raw_stream: torch
                    .getattr("_C")?
                    .getattr("_cuda_getCurrentRawStream")
                    .ok()
                    .map(Bound::unbind),
                dtypes: TORCH_DTYPES
                    .iter()
                    .map(|(_, n)| torch.getattr(*n).ok().map(Bound::unbind))
                    .collect(),
                module: torch.clone().into_any().unbind(),
            })
        }
    }

    /// PyTorch's current stream of CUDA device `device`, as the raw `CUstream` (0: the legacy
    /// default stream). Where PyTorch has initialised CUDA, one call of
    /// `torch._C._cuda_getCurrentRawStream` (about 1 µs); else, or on a PyTorch without it,
    /// `torch.cuda.current_stream(device).cuda_stream`, which initialises PyTorch's CUDA state
    /// first and makes a `torch.cuda.Stream` (tens of µs).
    ///
    /// # Errors
    /// PyTorch's, as raised (no CUDA in this PyTorch, a bad device).
    pub(crate) fn current_stream(&self, py: Python<'_>, device: i32) -> PyResult<usize> {
        if let Some(raw) = &self.raw_stream
            && self.cuda_initialized(py)?
        {
            return raw.bind(py).call1((device,))?.extract();
        }
        self.cuda_current_stream
            .bind(py)
            .call1((device,))?
            .getattr("cuda_stream")?
            .extract()
    }

    /// `torch.cuda.is_initialized()`: whether PyTorch initialised CUDA in this process.
    ///
    /// # Errors
    /// PyTorch's, as raised.
    pub(crate) fn cuda_initialized(&self, py: Python<'_>) -> PyResult<bool> {
        self.cuda_is_initialized.bind(py).call0()?.is_truthy()
    }

    /// The `torch.dtype` of `d`, or `NotSupported`.
    pub(crate) fn dtype<'py>(&self, py: Python<'py>, d: DType) -> PyResult<&Bound<'py, PyAny>> {
        TORCH_DTYPES
            .iter()
            .position(|(x, _)| *x == d)
            .and_then(|i| self.dtypes[i].as_ref())
            .map(|o| o.bind(py))
            .ok_or_else(|| errors::not_supported(&format!("no PyTorch dtype for DLPack dtype {d}")))
    }

    /// Whether `v` is a `torch.Tensor` (of a subclass too), asked of the types' MROs alone
    /// (`PyType_IsSubtype`), so that no `__instancecheck__` of the caller's runs.
    pub(crate) fn is_tensor(&self, py: Python<'_>, v: &Bound<'_, PyAny>) -> bool {
        let t = self.tensor.bind(py);
        // SAFETY: both are live type objects (the GIL is held: `py`).
        unsafe { pyo3::ffi::PyType_IsSubtype(v.get_type().as_type_ptr(), t.as_type_ptr()) != 0 }
    }

    /// `f()` with `__torch_function__` turned off (`torch._C.DisableTorchFunction`): reading
    /// the sources' properties then runs none of the caller's Python code (a tensor subclass's
    /// override, a `TorchFunctionMode`), which could otherwise free a source whose copy is
    /// already enqueued. The properties read are the tensors' own.
    ///
    /// # Errors
    /// `f`'s, or entering or leaving the context's.
    pub(crate) fn without_torch_function<T>(
        &self,
        py: Python<'_>,
        f: impl FnOnce() -> PyResult<T>,
    ) -> PyResult<T> {
        let guard = self.disable_torch_function.bind(py).call0()?;
        guard.call_method0("__enter__")?;
        let r = f();
        let none = py.None();
        let left = guard.call_method1("__exit__", (&none, &none, &none));
        let r = r?;
        left?;
        Ok(r)
    }

    /// `list(map(f, items))`: one C-level loop over `items` (no bytecode, no bound methods).
    pub(crate) fn map_list<'py>(
        &self,
        py: Python<'py>,
        f: &Py<PyAny>,
        items: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let it = self.map.bind(py).call1((f.bind(py), items))?;
        Ok(self.list.bind(py).call1((it,))?.cast_into::<PyList>()?)
    }
}

/// Tensors made by one call: `members` (tensor indices, by rising offset) `step` bytes apart.
struct Run {
    members: Vec<usize>,
    step: u64,
}

/// How many following members of a group a run's start tries as its second member.
const STEP_CANDIDATES: usize = 8;

/// The tensors grouped into runs: tensors of one allocation, dtype, shape and strides whose
/// offsets rise by a constant step that is a whole number of elements (the experts of a MoE
/// layer; the same projection of every layer of a transformer, a layer's bytes apart), each run
/// as long as the offsets keep that step. Interleaved runs are told apart (a layer's k and v
/// projections, of one shape, back to back: every k one run, every v another): from the first
/// tensor not yet in a run, the step to each of the next few of its group is tried and the one
/// giving the longest run kept. A tensor alone is a run of one.
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
        // Position in `g` of each offset not yet in a run (offsets are distinct within a group
        // unless tensors alias; an aliased one stays a run of its own).
        let mut free: HashMap<u64, usize> = HashMap::with_capacity(g.len());
        for (p, &i) in g.iter().enumerate() {
            free.entry(tensors[i].offset).or_insert(p);
        }
        let mut taken = vec![false; g.len()];
        for p in 0..g.len() {
            if taken[p] {
                continue;
            }
            taken[p] = true;
            let first = tensors[g[p]].offset;
            if free.get(&first) == Some(&p) {
                free.remove(&first);
            }
            let chain = |step: u64, free: &HashMap<u64, usize>| {
                let mut n = 0;
                let mut at = first + step;
                while free.contains_key(&at) {
                    n += 1;
                    at += step;
                }
                n
            };
            let mut best = (0, 0u64);
            if size > 0 {
                let mut tried = 0;
                for q in p + 1..g.len() {
                    if tried == STEP_CANDIDATES {
                        break;
                    }
                    if taken[q] {
                        continue;
                    }
                    tried += 1;
                    let step = tensors[g[q]].offset - first;
                    if step > 0 && step.is_multiple_of(size) {
                        let n = chain(step, &free);
                        if n > best.0 {
                            best = (n, step);
                        }
                    }
                }
            }
            let mut run = Run {
                members: vec![g[p]],
                step: best.1,
            };
            let mut at = first + best.1;
            for _ in 0..best.0 {
                let q = free
                    .remove(&at)
                    .expect("the chain was counted over free offsets");
                taken[q] = true;
                run.members.push(g[q]);
                at += best.1;
            }
            out.push(run);
        }
    }
    out
}

/// One allocation's typed bases (by dtype), and its base of bytes once a dtype needed one.
struct Base<'py> {
    bytes: Option<Bound<'py, PyAny>>,
    typed: HashMap<DType, Bound<'py, PyAny>>,
}

/// The DLPack dtype a base of `d` is exported as, where every PyTorch that reads DLPack takes
/// it as that dtype (`torch.from_dlpack`: the floats of 16 to 64 bits, bfloat16, the signed
/// ints, uint8); `None` for the others (bool, complex, the wider uints, fp8), which are views of
/// a base of bytes (`view(dtype)`), as PyTorch names them.
fn exported_as_itself(d: DType) -> Option<DLDataType> {
    const EXPORTED: &[DType] = &[
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::F64,
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::U8,
    ];
    EXPORTED.contains(&d).then_some(DLDataType {
        code: DLDataTypeCode(d.code),
        bits: d.bits,
        lanes: d.lanes,
    })
}

/// The tensors' names as Python `str`s, in the layout's order: made once per reader or writer
/// (the layout never changes) and shared by every dict built from it.
pub(crate) fn name_strings(py: Python<'_>, layout: &Layout) -> PyResult<Py<PyTuple>> {
    Ok(PyTuple::new(
        py,
        layout.tensors().iter().map(|t| PyString::new(py, &t.name)),
    )?
    .unbind())
}

/// Builds the tensors of one buffer: `bases[a]` is allocation `a`'s address and length (`None`
/// when no tensor lies there), `device` the CUDA ordinal (-1: host memory, CPU tensors),
/// `names` the layout's [`name_strings`], `owner` what the bases keep alive (the reader; `None`
/// for a writer's buffer, valid while the writer lives).
///
/// The calls into PyTorch: one `torch.from_dlpack` per allocation and dtype (for a dtype DLPack
/// cannot name to every PyTorch, [`exported_as_itself`], one per allocation, and a `narrow` and
/// a `view` per allocation and dtype), and an `as_strided` per run (and an `unbind` per run of
/// several).
pub(crate) fn build<'py>(
    py: Python<'py>,
    layout: &Layout,
    bases: &[Option<(u64, usize)>],
    device: i32,
    names: &Bound<'py, PyTuple>,
    owner: Option<Arc<dyn Any + Send + Sync>>,
) -> PyResult<Bound<'py, PyDict>> {
    let torch = Torch::needed(py, "tensors() makes torch.Tensor views", device < 0)?;
    let from_dlpack = torch.from_dlpack.bind(py);
    let as_strided = torch.as_strided.bind(py);
    let no_sync = (-1i64).into_pyobject(py)?.into_any();
    // One typed base per allocation and dtype, made at its first need: exported as that dtype
    // where PyTorch's `from_dlpack` takes it (one call, where a base of bytes costs a `narrow`
    // and a `view` more, a fresh process's first of each a tenth of a millisecond and more);
    // else a view of the allocation's base of bytes.
    let export = |ptr: u64, nbytes: usize, dtype: DLDataType| -> PyResult<Bound<'py, PyAny>> {
        let export = Export {
            hold: match &owner {
                Some(o) => Hold::Owner(o.clone()),
                None => Hold::None,
            },
            ptr,
            nbytes,
            dtype,
            device,
            ready_on: 0,
            frame: None,
            target: Mutex::new(None),
        };
        // `stream=-1`: no ordering here; the caller orders the tensors' stream with the
        // generation's (`Held::ready_on_raw`).
        let capsule = export.export(py, Some(&no_sync), None, None, None)?;
        from_dlpack.call1((capsule,))
    };
    let mut made: Vec<Option<Base<'py>>> = bases
        .iter()
        .map(|b| {
            b.map(|_| Base {
                bytes: None,
                typed: HashMap::new(),
            })
        })
        .collect();
    let tensors = layout.tensors();
    let mut made_tensors: Vec<Option<Bound<'py, PyAny>>> = vec![None; tensors.len()];
    for run in runs(tensors) {
        let t = &tensors[run.members[0]];
        let size =
            t.dtype.size_bytes().ok_or_else(|| {
                errors::not_supported(&format!("tensor {:?}: sub-byte dtype", t.name))
            })? as u64;
        let alloc = t.allocation as usize;
        let base = made
            .get_mut(alloc)
            .and_then(Option::as_mut)
            .ok_or_else(|| errors::not_supported("a tensor outside the set's allocations"))?;
        let typed = match base.typed.get(&t.dtype) {
            Some(v) => v.clone(),
            None => {
                let (ptr, n) = bases[alloc].map_or((0, 0), |(p, len)| (p, len as u64));
                let whole = n - n % size;
                let v = match exported_as_itself(t.dtype) {
                    Some(dl) => export(ptr, whole as usize, dl)?,
                    None => {
                        let bytes = match &base.bytes {
                            Some(b) => b.clone(),
                            None => {
                                let b = export(ptr, n as usize, crate::dlpack::BYTES)?;
                                base.bytes = Some(b.clone());
                                b
                            }
                        };
                        let dt = torch.dtype(py, t.dtype)?;
                        let narrowed = torch.narrow.bind(py).call1((bytes, 0, 0, whole))?;
                        torch.view.bind(py).call1((narrowed, dt))?
                    }
                };
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
            let parts = torch.unbind.bind(py).call1((stacked,))?;
            let parts = parts.cast::<PyTuple>()?;
            for (k, v) in parts.iter().enumerate() {
                made_tensors[run.members[k]] = Some(v);
            }
        }
    }
    let d = PyDict::new(py);
    for (name, v) in names.iter().zip(made_tensors) {
        d.set_item(name, v)?;
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
    fn interleaved_runs_of_one_shape_are_told_apart() {
        // Layers of [k (4x8), v (4x8), norm (8)], each layer 768 bytes: k and v have one shape and
        // lie back to back, yet every k forms one run and every v another.
        let mut t = Vec::new();
        for l in 0..5u64 {
            t.push(info(&format!("l{l}.k"), &[4, 8], l * 768));
            t.push(info(&format!("l{l}.v"), &[4, 8], l * 768 + 256));
            t.push(info(&format!("l{l}.norm"), &[8], l * 768 + 512));
        }
        let r = runs(&t);
        assert_eq!(
            members(&r),
            vec![
                vec![0, 3, 6, 9, 12],
                vec![1, 4, 7, 10, 13],
                vec![2, 5, 8, 11, 14]
            ]
        );
        assert!(r.iter().all(|r| r.step == 768));
    }

    #[test]
    fn aliased_tensors_each_land_in_exactly_one_run() {
        let t = vec![
            info("a", &[4, 8], 0),
            info("a2", &[4, 8], 0),
            info("b", &[4, 8], 64),
            info("c", &[4, 8], 128),
        ];
        let r = runs(&t);
        let mut all: Vec<usize> = r.iter().flat_map(|r| r.members.clone()).collect();
        all.sort();
        assert_eq!(all, vec![0, 1, 2, 3]);
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
