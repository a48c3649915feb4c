//! The CUDA driver, loaded at run time by this crate (no link-time `libcuda`): the library by its
//! soname `libcuda.so.1` first, then cudarc's candidate names ([`sys`]), and its functions called
//! through [`sys`] with cudarc's types and signatures.
//!
//! Owns: the driver library and the driver functions the crate calls ([`sys`]: one `dlopen` per
//! process, one `dlsym` per function), the one check that the library loaded and `cuInit`
//! succeeded (every entry point calls [`driver_api`] first), [`CudaError`] (this layer's error,
//! re-exported as `cuda_ipc::CudaError`) and the conversion of `CUresult` into it, and the
//! error-name lookups. Nothing above this module calls `sys` without having gone through
//! [`driver_api`]. Must not touch: cudarc's own driver loader (`cudarc::driver::sys::culib`),
//! which tries `libcuda.so` before the soname and so loads a toolkit's stub library where one is
//! on the search path; cudarc's safe API (the `cudarc` feature's `cudarc_interop`) uses it for its
//! own calls.

use crate::error::{Error, Result};
use std::ffi::CStr;
use std::fmt;
use std::sync::OnceLock;

pub(crate) mod sys;

/// A failed CUDA driver call: the call's name and the `CUresult` it returned.
///
/// `Display` reads `cuIpcOpenMemHandle_v2 failed: CUDA_ERROR_INVALID_CONTEXT (invalid device context)`.
/// The name and text come from `cuGetErrorName` / `cuGetErrorString`; the raw number is kept for codes
/// newer than the bindings.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct CudaError {
    /// The driver entry point that failed, e.g. `"cuIpcOpenMemHandle_v2"`.
    pub call: &'static str,
    /// The raw `CUresult` value.
    pub code: u32,
}

impl CudaError {
    /// The driver's name for the code (`CUDA_ERROR_INVALID_VALUE`), from `cuGetErrorName`; where
    /// the library cannot name it (none loaded, or a toolkit's stub), the bindings' name; else
    /// `CUDA_ERROR_<n>`.
    pub fn name(&self) -> String {
        error_name(self.code)
            .or_else(|| known_result(self.code).map(|r| format!("{r:?}")))
            .unwrap_or_else(|| format!("CUDA_ERROR_{}", self.code))
    }

    /// The driver's description of the code, from `cuGetErrorString`; for
    /// `CUDA_ERROR_STUB_LIBRARY` (34), which a toolkit's stub library answers to every call and
    /// cannot describe, what was loaded and what to do; else `unknown error` when none.
    pub fn description(&self) -> String {
        error_string(self.code).unwrap_or_else(|| {
            if self.code == sys::CUresult::CUDA_ERROR_STUB_LIBRARY as u32 {
                let loaded = sys::library().map_or("?", |l| l.name());
                format!(
                    "the library loaded as the CUDA driver, {loaded}, is a CUDA toolkit's stub \
                     and not the driver, and {} was not found: install the NVIDIA driver, or put \
                     the folder holding it first on LD_LIBRARY_PATH",
                    sys::SONAME
                )
            } else {
                "unknown error".to_string()
            }
        })
    }
}

impl fmt::Display for CudaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} failed: {} ({})",
            self.call,
            self.name(),
            self.description()
        )
    }
}

impl fmt::Debug for CudaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaError")
            .field("call", &self.call)
            .field("code", &self.code)
            .field("name", &self.name())
            .finish()
    }
}

impl std::error::Error for CudaError {}

/// Proof that the driver library was loaded and `cuInit(0)` succeeded in this process.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DriverApi(());

/// [`driver_api`]'s outcome, once it ran.
static INIT: OnceLock<std::result::Result<(), InitFailure>> = OnceLock::new();

/// Loads the driver library (once per process: [`sys::library`], `libcuda.so.1` first) and runs
/// `cuInit(0)`.
///
/// # Errors
/// [`Error::DriverNotFound`] when no candidate library loads (`searched`: every name of
/// [`sys::driver_candidates`]); [`Error::Cuda`] when `cuInit` fails
/// (e.g. `CUDA_ERROR_NO_DEVICE`).
pub(crate) fn driver_api() -> Result<DriverApi> {
    let r = INIT.get_or_init(|| {
        if sys::library().is_none() {
            return Err(InitFailure::NotFound(sys::driver_candidates().join(", ")));
        }
        // SAFETY: `cuInit` takes a flags word that must be 0 (the library loaded just above).
        let code = unsafe { sys::cuInit(0) };
        check("cuInit", code).map_err(InitFailure::Cuda)
    });
    match r {
        Ok(()) => Ok(DriverApi(())),
        Err(InitFailure::NotFound(s)) => Err(Error::DriverNotFound {
            searched: s.clone(),
        }),
        Err(InitFailure::Cuda(e)) => Err(Error::Cuda(*e)),
    }
}

/// Whether this process has the driver loaded and initialised already (another library made a
/// context: PyTorch, CuPy, JAX), asked without loading the library or initialising the driver:
/// `libcuda.so.1` must be in the process already (`dlopen` with `RTLD_NOLOAD`, which loads
/// nothing and runs no initialiser) and be the library [`sys::library`] uses (its first name, so
/// nothing is searched), and `cuCtxGetCurrent` must not answer `CUDA_ERROR_NOT_INITIALIZED`
/// (which every driver call returns before `cuInit`, per the driver API's initialisation
/// section); or [`driver_api`] succeeded already.
pub(crate) fn initialized_elsewhere() -> bool {
    if matches!(INIT.get(), Some(Ok(()))) {
        return true; // loaded and initialised by this crate already: no name is tried again
    }
    let Some(in_process) = sys::loaded(sys::SONAME) else {
        return false; // not in the process: nothing is loaded or searched
    };
    // The loader's first name is the soname, which the dynamic linker answers with the library
    // already loaded (no search); a loader that settled on another library earlier (the soname did
    // not load then) is not that one.
    if !sys::library().is_some_and(|lib| lib.is(&in_process)) {
        return false;
    }
    drop(in_process);
    let mut ctx = std::ptr::null_mut();
    // SAFETY: `ctx` is a valid out-pointer. Before `cuInit` the driver answers
    // `CUDA_ERROR_NOT_INITIALIZED` and does nothing else.
    let code = unsafe { sys::cuCtxGetCurrent(&mut ctx) };
    code == sys::CUresult::CUDA_SUCCESS
}

#[derive(Debug)]
enum InitFailure {
    NotFound(String),
    Cuda(CudaError),
}

/// Turns a `CUresult` into `Ok(())` or a [`CudaError`] naming `call`.
#[inline]
pub(crate) fn check(call: &'static str, code: sys::CUresult) -> std::result::Result<(), CudaError> {
    if code == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CudaError {
            call,
            code: code as u32,
        })
    }
}

/// `cuGetErrorName` for a raw code; `None` without a driver or for an unknown code.
pub(crate) fn error_name(code: u32) -> Option<String> {
    lookup(code, true)
}

/// `cuGetErrorString` for a raw code; `None` without a driver or for an unknown code.
pub(crate) fn error_string(code: u32) -> Option<String> {
    lookup(code, false)
}

fn lookup(code: u32, name: bool) -> Option<String> {
    driver_api().ok()?;
    // A code newer than the bindings has no enum variant; transmuting it would be undefined, so
    // only codes the bindings know are passed to the driver.
    let known = known_result(code)?;
    let mut out: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: the driver is loaded (`driver_api` above); `out` is a valid place for one pointer;
    // the driver writes a pointer to a static NUL-terminated string or returns an error.
    let r = unsafe {
        if name {
            sys::cuGetErrorName(known, &mut out)
        } else {
            sys::cuGetErrorString(known, &mut out)
        }
    };
    if r != sys::CUresult::CUDA_SUCCESS || out.is_null() {
        return None;
    }
    // SAFETY: on success `out` points to a static NUL-terminated string owned by the driver.
    Some(
        unsafe { CStr::from_ptr(out) }
            .to_string_lossy()
            .into_owned(),
    )
}

/// The `CUresult` variant with this value, if the bindings have one.
fn known_result(code: u32) -> Option<sys::CUresult> {
    use sys::CUresult as R;
    // The variants the bindings define, as a table; anything else stays a raw number.
    const ALL: &[R] = &[
        R::CUDA_SUCCESS,
        R::CUDA_ERROR_INVALID_VALUE,
        R::CUDA_ERROR_OUT_OF_MEMORY,
        R::CUDA_ERROR_NOT_INITIALIZED,
        R::CUDA_ERROR_DEINITIALIZED,
        R::CUDA_ERROR_NO_DEVICE,
        R::CUDA_ERROR_INVALID_DEVICE,
        R::CUDA_ERROR_INVALID_IMAGE,
        R::CUDA_ERROR_INVALID_CONTEXT,
        R::CUDA_ERROR_MAP_FAILED,
        R::CUDA_ERROR_UNMAP_FAILED,
        R::CUDA_ERROR_ALREADY_MAPPED,
        R::CUDA_ERROR_NO_BINARY_FOR_GPU,
        R::CUDA_ERROR_NOT_MAPPED,
        R::CUDA_ERROR_UNSUPPORTED_LIMIT,
        R::CUDA_ERROR_CONTEXT_ALREADY_IN_USE,
        R::CUDA_ERROR_PEER_ACCESS_UNSUPPORTED,
        R::CUDA_ERROR_INVALID_PTX,
        R::CUDA_ERROR_INVALID_SOURCE,
        R::CUDA_ERROR_FILE_NOT_FOUND,
        R::CUDA_ERROR_SHARED_OBJECT_INIT_FAILED,
        R::CUDA_ERROR_OPERATING_SYSTEM,
        R::CUDA_ERROR_INVALID_HANDLE,
        R::CUDA_ERROR_ILLEGAL_STATE,
        R::CUDA_ERROR_NOT_FOUND,
        R::CUDA_ERROR_NOT_READY,
        R::CUDA_ERROR_ILLEGAL_ADDRESS,
        R::CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES,
        R::CUDA_ERROR_LAUNCH_TIMEOUT,
        R::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED,
        R::CUDA_ERROR_PEER_ACCESS_NOT_ENABLED,
        R::CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE,
        R::CUDA_ERROR_CONTEXT_IS_DESTROYED,
        R::CUDA_ERROR_ASSERT,
        R::CUDA_ERROR_LAUNCH_FAILED,
        R::CUDA_ERROR_NOT_PERMITTED,
        R::CUDA_ERROR_NOT_SUPPORTED,
        R::CUDA_ERROR_SYSTEM_NOT_READY,
        R::CUDA_ERROR_SYSTEM_DRIVER_MISMATCH,
        R::CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE,
        R::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
        R::CUDA_ERROR_STUB_LIBRARY,
        R::CUDA_ERROR_UNKNOWN,
    ];
    ALL.iter().copied().find(|r| *r as u32 == code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_display_names_call_and_keeps_raw_code_without_driver() {
        let e = CudaError {
            call: "cuIpcOpenMemHandle_v2",
            code: 201,
        };
        let s = e.to_string();
        assert!(s.starts_with("cuIpcOpenMemHandle_v2 failed: "), "{s}");
        // Without a driver the name falls back to the raw number; with one it is the driver's name.
        assert!(
            s.contains("CUDA_ERROR_201") || s.contains("CUDA_ERROR_INVALID_CONTEXT"),
            "{s}"
        );
    }

    #[test]
    fn unknown_codes_are_not_transmuted() {
        assert!(known_result(123_456).is_none());
        assert_eq!(known_result(0), Some(sys::CUresult::CUDA_SUCCESS));
    }
}
