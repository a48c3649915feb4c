//! PyTorch's pluggable allocator over the library's VMM arena (`cuda_ipc::ipc::VmmArena`), so that
//! tensors PyTorch allocates in a `torch.cuda.MemPool` live in fd-exportable memory that a tensor
//! set publishes without a copy.
//!
//! The extension's shared object exports two C functions, [`cuda_ipc_torch_malloc`] and
//! [`cuda_ipc_torch_free`], with the signatures `torch.cuda.memory.CUDAPluggableAllocator`
//! loads; [`torch_mem_pool`] builds the `MemPool` over them. One arena per device, in the device's
//! primary context (the one PyTorch uses), made on first use and kept for the life of the process:
//! its chunks (1 GiB each by default) are never released, since a tensor set may list them.
//!
//! PyTorch's caching allocator asks the pool for segments (2 MiB for small blocks, 20 MiB and more
//! for large ones) and frees a segment only when it releases cached memory, after its streams'
//! events completed, so the arena's free (not stream-ordered) reuses nothing a kernel still uses.
//! `torch.cuda.use_mem_pool(pool)` routes only the calling thread's allocations to the pool.
//!
//! [`arena_locate`] and [`arena_stats`] serve the writer that publishes a model's `state_dict()`:
//! each tensor's chunk and offset, and what the arenas hold. [`find`] is the same for Rust callers
//! of this crate (the tensor-set classes).

use crate::args::{Int, device_arg, opt_int};
use crate::errors::{self, bytes};
use crate::util::{err, lock};
use cuda_ipc::driver::Device;
use cuda_ipc::ipc::{ArenaOptions, ArenaStats, DEFAULT_CHUNK_BYTES, VmmArena, VmmBuffer};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::collections::BTreeMap;
use std::ffi::c_void;
use std::io::Write;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex};

/// The arena of each device ordinal that has one.
static ARENAS: Mutex<BTreeMap<i32, Arc<VmmArena>>> = Mutex::new(BTreeMap::new());

/// The names of the exported functions, as `CUDAPluggableAllocator` looks them up.
const MALLOC: &str = "cuda_ipc_torch_malloc";
const FREE: &str = "cuda_ipc_torch_free";

/// The arena of device `device`, made with `chunk_bytes` (default [`DEFAULT_CHUNK_BYTES`]) in the
/// device's primary context when it has none; an existing arena is returned whatever its chunk
/// size unless `chunk_bytes` names another one.
pub(crate) fn arena(device: i32, chunk_bytes: Option<usize>) -> cuda_ipc::Result<Arc<VmmArena>> {
    let mut arenas = lock(&ARENAS);
    if let Some(a) = arenas.get(&device) {
        return match chunk_bytes {
            Some(c) if c != a.options().chunk_bytes => {
                Err(cuda_ipc::Error::InvalidArgument(format!(
                    "device {device}'s arena exists already with chunks of {}, not {c}",
                    bytes(a.options().chunk_bytes)
                )))
            }
            _ => Ok(a.clone()),
        };
    }
    let ordinal = usize::try_from(device)
        .map_err(|_| cuda_ipc::Error::InvalidArgument(format!("device {device}")))?;
    let ctx = Device::get(ordinal)?.primary_context()?;
    let a = Arc::new(VmmArena::new(
        &ctx,
        ArenaOptions::with_chunk_bytes(chunk_bytes.unwrap_or(DEFAULT_CHUNK_BYTES)),
    )?);
    arenas.insert(device, a.clone());
    Ok(a)
}

/// The arena of `device` when it has one (none is made).
pub(crate) fn existing_arena(device: i32) -> Option<Arc<VmmArena>> {
    lock(&ARENAS).get(&device).cloned()
}

/// The arena holding device range `[ptr, ptr + len)`: (device ordinal, chunk index in that arena's
/// `chunks()`, the chunk's buffer, byte offset in it).
pub(crate) fn find(ptr: u64, len: usize) -> Option<(i32, usize, VmmBuffer, u64)> {
    let arenas: Vec<(i32, Arc<VmmArena>)> =
        lock(&ARENAS).iter().map(|(&d, a)| (d, a.clone())).collect();
    arenas
        .into_iter()
        .find_map(|(d, a)| a.locate(ptr, len).map(|(i, b, o)| (d, i, b, o)))
}

/// One line on stderr, the allocator's only way to say why it returned null (PyTorch then raises
/// its out-of-memory error). Never panics, even with stderr closed.
fn log(msg: std::fmt::Arguments<'_>) {
    let _ = writeln!(std::io::stderr(), "cuda_ipc torch allocator: {msg}");
}

/// Allocates `size` bytes on CUDA device `device` from its arena, for PyTorch's pluggable allocator
/// (`void* malloc(ssize_t size, int device, cudaStream_t stream)`). The address is aligned to
/// 512 bytes; `stream` is not used (the arena is not stream-ordered). Returns null for `size`
/// 0, and null with a line on stderr when the allocation fails (PyTorch raises its out-of-memory
/// error); a panic inside is caught and reported the same way, never unwound into the caller.
#[unsafe(no_mangle)]
pub extern "C" fn cuda_ipc_torch_malloc(
    size: isize,
    device: i32,
    _stream: *mut c_void,
) -> *mut c_void {
    if size == 0 {
        return std::ptr::null_mut();
    }
    let r = catch_unwind(AssertUnwindSafe(|| -> cuda_ipc::Result<u64> {
        let len = usize::try_from(size)
            .map_err(|_| cuda_ipc::Error::InvalidArgument(format!("size {size}")))?;
        arena(device, None)?.alloc(len)
    }));
    match r {
        Ok(Ok(p)) => p as usize as *mut c_void,
        Ok(Err(e)) => {
            log(format_args!(
                "{MALLOC}({}, device {device}) failed: {e}",
                bytes(size)
            ));
            std::ptr::null_mut()
        }
        Err(_) => {
            log(format_args!(
                "{MALLOC}({}, device {device}) panicked",
                bytes(size)
            ));
            std::ptr::null_mut()
        }
    }
}

/// Frees memory [`cuda_ipc_torch_malloc`] returned, for PyTorch's pluggable allocator (`void
/// free(void* ptr, size_t size, int device, cudaStream_t stream)`): the bytes go back to device
/// `device`'s arena at once (`stream` is not used; PyTorch frees a segment only after its work
/// completed). A null `ptr` does nothing; an address that is not a live allocation of that arena
/// changes nothing and logs a line on stderr; a panic inside is caught, never unwound.
#[unsafe(no_mangle)]
pub extern "C" fn cuda_ipc_torch_free(
    ptr: *mut c_void,
    size: usize,
    device: i32,
    _stream: *mut c_void,
) {
    if ptr.is_null() {
        return;
    }
    let addr = ptr as usize as u64;
    let r = catch_unwind(AssertUnwindSafe(|| -> cuda_ipc::Result<()> {
        match existing_arena(device) {
            Some(a) => a.free(addr),
            None => Err(cuda_ipc::Error::InvalidArgument(format!(
                "device {device} has no arena"
            ))),
        }
    }));
    match r {
        Ok(Ok(())) => {}
        Ok(Err(e)) => log(format_args!(
            "{FREE}({addr:#x}, {}, device {device}) failed: {e}",
            bytes(size)
        )),
        Err(_) => log(format_args!(
            "{FREE}({addr:#x}, {}, device {device}) panicked",
            bytes(size)
        )),
    }
}

/// A `torch.cuda.MemPool` whose memory comes from this extension's VMM arena on `device`
/// (`torch.cuda.memory.CUDAPluggableAllocator` over `cuda_ipc_torch_malloc` and
/// `cuda_ipc_torch_free` of the extension's shared object). Tensors allocated under
/// `torch.cuda.use_mem_pool(pool)` live in fd-exportable chunks (`chunk_bytes`, default 1 GiB,
/// fixed by the first call for a device) that a tensor set publishes without a copy; only the
/// calling thread's allocations are routed to the pool.
///
/// Raises `CudaUnavailable` without a CUDA driver or device, `InvalidArgument` for another chunk
/// size than the device's arena has, `ImportError` without PyTorch.
#[pyfunction]
#[pyo3(pass_module, signature = (device=Int::Small(0), *, chunk_bytes=None))]
#[pyo3(text_signature = "(device=0, *, chunk_bytes=None)")]
pub(crate) fn torch_mem_pool<'py>(
    m: &Bound<'py, PyModule>,
    device: Int,
    chunk_bytes: Option<Int>,
) -> PyResult<Bound<'py, PyAny>> {
    let py = m.py();
    let device = device_arg(py, device)? as i32;
    let chunk_bytes: Option<usize> = opt_int(py, "chunk_bytes", chunk_bytes)?;
    if chunk_bytes == Some(0) {
        return Err(errors::invalid_argument(
            py,
            "chunk_bytes must be at least 1".into(),
        ));
    }
    py.detach(|| arena(device, chunk_bytes))
        .map_err(|e| err(py, e))?;
    // The extension module's own file (the shared object), not the package's `__init__.py`.
    let path = m.getattr("__file__")?;
    let memory = py.import("torch.cuda.memory")?;
    let alloc = memory
        .getattr("CUDAPluggableAllocator")?
        .call1((path, MALLOC, FREE))?;
    py.import("torch.cuda")?
        .getattr("MemPool")?
        .call1((alloc.call_method0("allocator")?,))
}

/// Where device memory at `ptr` (`nbytes` bytes from it) lies in the extension's arenas:
/// `(chunk, offset)`, the chunk's index among its device's chunks and the byte offset in it.
/// Memory a `torch_mem_pool` allocated is found (any range inside one chunk).
///
/// Raises `InvalidArgument` when no arena holds the range (the tensor was not allocated in the
/// pool: publish it with a copy).
#[pyfunction]
#[pyo3(signature = (ptr, nbytes=Int::Small(1)), text_signature = "(ptr, nbytes=1)")]
pub(crate) fn arena_locate(py: Python<'_>, ptr: Int, nbytes: Int) -> PyResult<(usize, u64)> {
    let ptr: u64 = ptr.get(py, "ptr")?;
    let nbytes: usize = nbytes.get(py, "nbytes")?;
    match find(ptr, nbytes.max(1)) {
        Some((_, chunk, _, off)) => Ok((chunk, off)),
        None => Err(errors::invalid_argument(
            py,
            format!(
                "device memory {ptr:#x} ({}) is not in a cuda_ipc arena (allocate it under \
                 torch.cuda.use_mem_pool(cuda_ipc.torch_mem_pool()))",
                bytes(nbytes)
            ),
        )),
    }
}

/// What device `device`'s arena holds, as a dict: `chunks`, `reserved_bytes`, `in_use_bytes`,
/// `allocations` and `chunk_bytes` (all 0 before its first allocation).
///
/// Raises `CudaUnavailable` without a CUDA driver or that device.
#[pyfunction]
#[pyo3(signature = (device=Int::Small(0)), text_signature = "(device=0)")]
pub(crate) fn arena_stats(py: Python<'_>, device: Int) -> PyResult<Bound<'_, PyDict>> {
    let ordinal = device_arg(py, device)?;
    let device = ordinal as i32;
    py.detach(|| Device::get(ordinal).map(|_| ()))
        .map_err(|e| err(py, e))?;
    let a = existing_arena(device);
    let s = a.as_ref().map(|a| a.stats()).unwrap_or_default();
    stats_dict(
        py,
        &s,
        a.map_or(DEFAULT_CHUNK_BYTES, |a| a.options().chunk_bytes),
    )
}

fn stats_dict<'py>(
    py: Python<'py>,
    s: &ArenaStats,
    chunk_bytes: usize,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("chunks", s.chunks)?;
    d.set_item("reserved_bytes", s.reserved_bytes)?;
    d.set_item("in_use_bytes", s.in_use_bytes)?;
    d.set_item("allocations", s.allocations)?;
    d.set_item("chunk_bytes", chunk_bytes)?;
    Ok(d)
}
