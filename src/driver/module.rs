use super::{Context, Stream};
use crate::error::{Error, Result};
use crate::ffi::{check, sys};
use std::ffi::{CString, c_void};
use std::mem::MaybeUninit;
use std::sync::Arc;

/// A module loaded from PTX or a cubin (`cuModuleLoadData`), unloaded on drop. The driver
/// JIT-compiles PTX for the device of the context.
///
/// See <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MODULE.html>.
#[derive(Debug)]
pub struct Module {
    // Drop order: unloaded (in Drop) before `ctx` is released.
    raw: sys::CUmodule,
    ctx: Arc<Context>,
}

// SAFETY: a CUmodule is a process-wide driver handle; every use enters the context first.
unsafe impl Send for Module {}
// SAFETY: as for Send; loading functions from a module is thread-safe in the driver.
unsafe impl Sync for Module {}

/// A kernel in a [`Module`] (`CUfunction`). Holds its module alive.
#[derive(Debug, Clone)]
pub struct Function {
    raw: sys::CUfunction,
    module: Arc<Module>,
}

// SAFETY: a CUfunction is a driver handle valid while its module is loaded (held by `module`).
unsafe impl Send for Function {}
// SAFETY: as for Send; launches are thread-safe in the driver.
unsafe impl Sync for Function {}

/// Grid and block shape of a launch, and dynamic shared memory in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Blocks per grid (x, y, z).
    pub grid: (u32, u32, u32),
    /// Threads per block (x, y, z).
    pub block: (u32, u32, u32),
    /// Dynamic shared memory per block, in bytes.
    pub shared_mem_bytes: u32,
}

impl LaunchConfig {
    /// A one-dimensional grid-stride shape for `n` elements: 256 threads a block, at most 4,096
    /// blocks (kernels loop over the rest).
    pub fn for_elements(n: u64) -> LaunchConfig {
        let blocks = n.div_ceil(256).clamp(1, 4096) as u32;
        LaunchConfig {
            grid: (blocks, 1, 1),
            block: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}

impl Module {
    /// Loads PTX text (`cuModuleLoadData`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `ptx` holds a NUL byte; [`Error::Cuda`] with
    /// `CUDA_ERROR_INVALID_PTX` or `CUDA_ERROR_UNSUPPORTED_PTX_VERSION` (driver older than the PTX).
    #[doc(alias = "cuModuleLoadData")]
    pub fn from_ptx(ctx: &Arc<Context>, ptx: &str) -> Result<Arc<Module>> {
        let text = CString::new(ptx)
            .map_err(|_| Error::InvalidArgument("PTX text holds a NUL byte".into()))?;
        let _cur = ctx.enter()?;
        let mut raw = MaybeUninit::<sys::CUmodule>::uninit();
        // SAFETY: context current (`_cur`); `text` is NUL-terminated PTX valid for the call; `raw`
        // out-pointer.
        check("cuModuleLoadData", unsafe {
            sys::cuModuleLoadData(raw.as_mut_ptr(), text.as_ptr().cast())
        })?;
        Ok(Arc::new(Module {
            // SAFETY: written on success.
            raw: unsafe { raw.assume_init() },
            ctx: ctx.clone(),
        }))
    }

    /// The kernel named `name` (`cuModuleGetFunction`).
    ///
    /// # Errors
    /// [`Error::Cuda`] with `CUDA_ERROR_NOT_FOUND` when there is none.
    #[doc(alias = "cuModuleGetFunction")]
    pub fn function(self: &Arc<Self>, name: &str) -> Result<Function> {
        let cname = CString::new(name)
            .map_err(|_| Error::InvalidArgument("kernel name holds a NUL byte".into()))?;
        let _cur = self.ctx.enter()?;
        let mut raw = MaybeUninit::<sys::CUfunction>::uninit();
        // SAFETY: context current (`_cur`); module loaded; `cname` NUL-terminated; `raw`
        // out-pointer.
        check("cuModuleGetFunction", unsafe {
            sys::cuModuleGetFunction(raw.as_mut_ptr(), self.raw, cname.as_ptr())
        })?;
        Ok(Function {
            // SAFETY: written on success.
            raw: unsafe { raw.assume_init() },
            module: self.clone(),
        })
    }

    /// The context the module is loaded in.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        let r = self.ctx.enter().and_then(|_cur| {
            // SAFETY: context current (`_cur`); the module was loaded by this value and is unloaded
            // once; every Function holds an Arc to it, so none outlives it.
            check("cuModuleUnload", unsafe { sys::cuModuleUnload(self.raw) }).map_err(Into::into)
        });
        if let Err(e) = r {
            tracing::warn!("{e}; the module stays loaded until the context is torn down");
        }
    }
}

impl Function {
    /// Enqueues the kernel on `stream` (`cuLaunchKernel`).
    ///
    /// # Safety
    /// 1. `params` holds one pointer per kernel parameter, in order, each pointing to a value of
    ///    exactly the parameter's type, valid for the duration of this call.
    /// 2. Every device pointer passed is valid in the stream's context for all the kernel accesses,
    ///    until the kernel completes.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `stream` belongs to another context; [`Error::Cuda`] naming
    /// `cuLaunchKernel` (e.g. `CUDA_ERROR_INVALID_VALUE` for a bad shape).
    #[doc(alias = "cuLaunchKernel")]
    pub unsafe fn launch(
        &self,
        cfg: LaunchConfig,
        stream: &Stream,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        self.module.ctx.same_as(stream.context())?;
        let _cur = self.module.ctx.enter()?;
        // SAFETY: context current (`_cur`); function valid while `module` is held; the caller
        // guarantees the parameter list (obligation 1) and the pointers' validity (obligation 2).
        check("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                self.raw,
                cfg.grid.0,
                cfg.grid.1,
                cfg.grid.2,
                cfg.block.0,
                cfg.block.1,
                cfg.block.2,
                cfg.shared_mem_bytes,
                stream.as_raw(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })?;
        Ok(())
    }
}
