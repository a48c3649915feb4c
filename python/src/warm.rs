//! `warm_up()` and its run at import: a process's one-time costs of a first attach, paid before
//! it, where that changes nothing else in the process.
//!
//! A first `TensorSetReader` and `tensors()` in a process pay, besides their own work, this
//! extension's first driver calls (the driver library's `dlopen`, `cuInit`, the first use of each driver
//! function, and a process's first thread start, which the open's join thread would pay:
//! [`cuda_ipc::driver::warm_up`]) and PyTorch's first calls of the views a dict is made
//! of (`torch.from_dlpack` of this extension's capsule, `as_strided`, `unbind`, `narrow`,
//! `view`, `torch.cuda.current_stream`): 0.25–0.3 ms on an H100 host with PyTorch 2.11, measured
//! in fresh processes. Both are made here on a tensor set of four tensors over 1 KiB of this
//! process's host memory, built exactly as a reader's dict is ([`tensors::build`]).
//!
//! Nothing here loads the driver, initialises CUDA, makes a context or imports PyTorch: each part
//! runs only where the process did that itself already (so a process that forks children after
//! importing this module keeps them free to use CUDA). Importing the module runs it once unless
//! `CUDA_IPC_WARM_UP` is `0` (or `false`, `no`, `off`); imported before the process made its CUDA context, the first attach pays
//! those costs unless `warm_up()` is called after it.

use crate::tensors;
use cuda_ipc::tensorset::{DType, Layout, TensorSpec};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::sync::Arc;

/// The environment variable that, set to `0`, leaves the import without [`warm_up`].
pub(crate) const ENV: &str = "CUDA_IPC_WARM_UP";

/// Makes this process's one-time costs of a first tensor-set attach now, where the process has
/// made them possible already: the driver's part where CUDA is initialised and a context is
/// current on this thread (its device's primary context active), PyTorch's part where `torch`
/// is imported (`torch.cuda.current_stream` only where `torch.cuda.is_initialized()`, on the
/// prepared device). Never
/// loads the driver, initialises CUDA, makes a context or imports PyTorch; raises nothing (a
/// step that fails is left to the first real use, which reports it; `KeyboardInterrupt` and
/// other errors that are no `Exception` are raised). Runs at import unless `CUDA_IPC_WARM_UP`
/// is `0`, `false`, `no` or `off`. Returns `{"device": the prepared device's ordinal or None, "torch":
/// whether PyTorch's calls were made}`. Takes 0.3–1 ms at its first call, tens of µs after
/// (the small dict is built again).
#[pyfunction]
pub(crate) fn warm_up(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let device = py.detach(cuda_ipc::driver::warm_up);
    let ordinal = device.map(|d| d.ordinal() as i32);
    let torch = match torch_part(py) {
        Ok(made) => made,
        Err(e) => {
            interrupt(py, e)?;
            false
        }
    };
    // Only on the device whose context is current and active: asked for another device's
    // stream, PyTorch could make that device's context.
    if torch && let Some(dev) = ordinal {
        let stream = (|| -> PyResult<()> {
            let t = crate::tensors::Torch::get(py)?;
            if t.cuda_initialized(py)? {
                t.current_stream(py, dev)?;
            }
            Ok(())
        })();
        if let Err(e) = stream {
            interrupt(py, e)?;
        }
    }
    let out = PyDict::new(py);
    out.set_item("device", ordinal)?;
    out.set_item("torch", torch)?;
    Ok(out)
}

/// `Err(e)` where `e` is no `Exception` (`KeyboardInterrupt`, `SystemExit`: the caller's to
/// see); `Ok(())` for any other error, which the warm-up leaves to the first real use.
fn interrupt(py: Python<'_>, e: PyErr) -> PyResult<()> {
    if e.is_instance_of::<pyo3::exceptions::PyException>(py) {
        Ok(())
    } else {
        Err(e)
    }
}

/// Whether [`ENV`]'s value turns the import's warm-up off: `0`, `false`, `no` or `off`, in any
/// case, spaces around it ignored.
fn off(v: &std::ffi::OsStr) -> bool {
    let v = v.to_string_lossy().trim().to_ascii_lowercase();
    matches!(v.as_str(), "0" | "false" | "no" | "off")
}

/// [`warm_up`] at import, unless [`ENV`] turns it off ([`off`]); of what it meets, only what is
/// no `Exception` (`KeyboardInterrupt`) is raised, which fails the import.
pub(crate) fn at_import(py: Python<'_>) -> PyResult<()> {
    if std::env::var_os(ENV).is_some_and(|v| off(&v)) {
        return Ok(());
    }
    warm_up(py).map(drop)
}

/// PyTorch's first calls of a dict's views, where `torch` is imported, whole: its module's own
/// dictionary (read without an attribute lookup, so that a lazily loaded `torch` is not loaded
/// by it) has `Tensor`, and its spec does not say it is being imported (by another thread: its
/// attributes would wait for that import). Whether the calls were made.
fn torch_part(py: Python<'_>) -> PyResult<bool> {
    let modules = py.import("sys")?.getattr("modules")?;
    let Some(torch) = modules.get_item("torch").ok() else {
        return Ok(false);
    };
    let Ok(module) = torch.cast::<pyo3::types::PyModule>() else {
        return Ok(false); // not a module: nothing PyTorch would be
    };
    let dict = module.dict();
    if !dict.contains("Tensor")? {
        return Ok(false); // not loaded yet (lazily), or being imported
    }
    if let Some(spec) = dict.get_item("__spec__")?
        && !spec.is_none()
        && spec
            .getattr("_initializing")
            .and_then(|v| v.is_truthy())
            .unwrap_or(false)
    {
        return Ok(false);
    }
    let specs = [
        // Three of one shape at a constant step (one `as_strided` and an `unbind`), one alone,
        // one of a dtype PyTorch's `from_dlpack` does not take from every library (a base of
        // bytes, `narrow`, `view`).
        TensorSpec::new("a", DType::BF16, &[4, 4]),
        TensorSpec::new("b", DType::BF16, &[4, 4]),
        TensorSpec::new("c", DType::BF16, &[4, 4]),
        TensorSpec::new("d", DType::BOOL, &[2]),
    ];
    let layout = Layout::new(&specs).map_err(|e| crate::errors::not_supported(&e.to_string()))?;
    let bytes = layout.allocations()[0] as usize;
    // 8-byte words: every element of the layout is aligned as its dtype wants.
    let memory: Arc<Vec<u64>> = Arc::new(vec![0; bytes.div_ceil(8)]);
    let base = memory.as_ptr() as u64;
    let names = tensors::name_strings(py, &layout)?;
    let owner: Arc<dyn std::any::Any + Send + Sync> = memory;
    let d = tensors::build(
        py,
        &layout,
        &[Some((base, bytes))],
        -1,
        names.bind(py),
        Some(owner),
    )?;
    drop(d);
    Ok(true)
}
