//! The driver library (`libcuda.so.1`), opened by this crate, and the driver functions the crate
//! calls, each resolved in it once.
//!
//! Owns: which library is the driver (the soname `libcuda.so.1` first, as the driver installs it
//! and as the NVIDIA container toolkit mounts it, then cudarc's candidate names for other
//! installs: [`driver_candidates`]), its one `dlopen` per process ([`library`]), and one function
//! per driver entry point the crate calls, with cudarc's name, signature and symbol
//! (`cuMemAlloc_v2`), so a call site writes `sys::cuMemAlloc_v2(..)` as with cudarc's bindings.
//! Everything else of `cudarc::driver::sys` (the types, the enums, the constants) is re-exported
//! as it is. Must not touch: cudarc's own loader (`cudarc::driver::sys::culib`), which tries
//! `libcuda.so` first and so loads a toolkit's stub library (whose every call returns
//! `CUDA_ERROR_STUB_LIBRARY`) where one is on the search path. `tests/driver_calls.rs` checks that
//! every `sys::cu…` call of the sources names a function defined here, so none reaches it.
//!
//! A function whose symbol the library lacks (a driver older than the call) returns
//! `CUDA_ERROR_NOT_FOUND` and logs the name once; one called where no library loads returns
//! `CUDA_ERROR_NOT_INITIALIZED`. Neither panics.

pub(crate) use cudarc::driver::sys::*;
use std::ffi::{CString, c_char, c_int, c_uint, c_ulonglong, c_void};
use std::ptr::NonNull;
use std::sync::OnceLock;

/// The driver's soname, the name tried first: what the driver package installs, what the NVIDIA
/// container toolkit mounts into a container, and what PyTorch and the CUDA runtime load.
pub(crate) const SONAME: &str = "libcuda.so.1";

/// The file names tried for the driver, in order, each once: [`SONAME`], then cudarc's candidates
/// (`cudarc::get_lib_name_candidates("cuda")`: `libcuda.so`, `libcuda64.so`, … for odd installs).
pub(crate) fn driver_candidates() -> Vec<String> {
    let mut names = vec![SONAME.to_string()];
    names.extend(cudarc::get_lib_name_candidates("cuda"));
    // cudarc's list repeats some names and ends with the soname; each is tried (and reported) once,
    // at its first place.
    let mut seen = std::collections::HashSet::new();
    names.retain(|n| seen.insert(n.clone()));
    names
}

/// The driver library of this process: a `dlopen` handle, never closed, and the name it was
/// opened by.
#[derive(Debug)]
pub(crate) struct Library {
    handle: NonNull<c_void>,
    name: String,
}

// SAFETY: the handle is an opaque token of the dynamic linker, valid in every thread of the
// process; it is never closed (so never dangles), and `dlsym` on it is thread-safe (POSIX:
// `dlsym` is not on the list of functions that need not be thread-safe).
unsafe impl Send for Library {}
// SAFETY: as for `Send`: shared use only passes the handle to `dlsym` and compares it.
unsafe impl Sync for Library {}

impl Library {
    /// Whether `other` is this library (the dynamic linker gives one handle per library).
    pub(crate) fn is(&self, other: &Loaded) -> bool {
        self.handle == other.0
    }

    /// The file name it was opened by (one of [`driver_candidates`]).
    pub(crate) fn name(&self) -> &str {
        &self.name
    }
}

/// [`library`]'s outcome, once it ran: `None` when no candidate loads.
static LIBRARY: OnceLock<Option<Library>> = OnceLock::new();

/// The driver library, opened on the first call in the process (each of [`driver_candidates`] in
/// order, `dlopen` with `RTLD_LAZY | RTLD_LOCAL`, the first that loads is kept), or `None` when
/// none loads; later calls return the first call's answer without trying again.
pub(crate) fn library() -> Option<&'static Library> {
    LIBRARY
        .get_or_init(|| {
            driver_candidates().into_iter().find_map(|name| {
                let handle = dlopen(&name, libc::RTLD_LAZY | libc::RTLD_LOCAL)?;
                tracing::debug!(library = %name, "loaded the CUDA driver");
                Some(Library { handle, name })
            })
        })
        .as_ref()
}

/// A reference to a library already in the process, from [`loaded`]; dropping it gives the
/// reference back (`dlclose`), and the library stays while other references (the loader's,
/// another library's) hold it.
#[derive(Debug)]
pub(crate) struct Loaded(NonNull<c_void>);

impl Drop for Loaded {
    fn drop(&mut self) {
        // SAFETY: the handle came from `dlopen` in `loaded` and is closed once, here; the loader's
        // own handle to the same library is a reference of its own.
        unsafe { libc::dlclose(self.0.as_ptr()) };
    }
}

/// The library already in this process under `name`, asked without loading anything
/// (`RTLD_NOLOAD`: no file is searched, no initialiser runs), or `None`.
pub(crate) fn loaded(name: &str) -> Option<Loaded> {
    dlopen(name, libc::RTLD_LAZY | libc::RTLD_NOLOAD).map(Loaded)
}

/// `dlopen(name, flags)`, `None` when it fails (or `name` holds a NUL byte).
fn dlopen(name: &str, flags: c_int) -> Option<NonNull<c_void>> {
    let name = CString::new(name).ok()?;
    // SAFETY: `name` is NUL-terminated and outlives the call; `flags` are valid `dlopen` flags.
    NonNull::new(unsafe { libc::dlopen(name.as_ptr(), flags) })
}

/// The address of the driver function `symbol` in [`library`]: `Err` with the `CUresult` its
/// wrapper returns instead when there is no library (`CUDA_ERROR_NOT_INITIALIZED`) or no such
/// symbol in it (`CUDA_ERROR_NOT_FOUND`, logged once per function, as the caller caches it).
fn resolve(symbol: &str) -> Result<NonNull<c_void>, CUresult> {
    let Some(lib) = library() else {
        return Err(CUresult::CUDA_ERROR_NOT_INITIALIZED);
    };
    let Ok(c_symbol) = CString::new(symbol) else {
        return Err(CUresult::CUDA_ERROR_NOT_FOUND); // not a symbol name
    };
    // SAFETY: the handle came from `dlopen` and is never closed; `c_symbol` is NUL-terminated and
    // outlives the call.
    let f = unsafe { libc::dlsym(lib.handle.as_ptr(), c_symbol.as_ptr()) };
    NonNull::new(f).ok_or_else(|| {
        tracing::warn!(
            library = %lib.name,
            "the CUDA driver has no {symbol} (it is older than this call): the call answers \
             CUDA_ERROR_NOT_FOUND"
        );
        CUresult::CUDA_ERROR_NOT_FOUND
    })
}

/// One `pub(crate) unsafe fn` per line `fn name(arg: Type, ...);`: the driver function `name`,
/// with cudarc's signature, returning `CUresult`; its symbol is resolved by [`resolve`] on the
/// first call and cached.
macro_rules! driver_functions {
    ($(fn $name:ident($($arg:ident: $ty:ty),* $(,)?);)*) => {$(
        #[doc = concat!("`", stringify!($name), "` of the driver library [`library`] loaded.")]
        #[doc = ""]
        #[doc = "The symbol is resolved on the first call. Returns `CUDA_ERROR_NOT_INITIALIZED`"]
        #[doc = "without a library and `CUDA_ERROR_NOT_FOUND` where the library lacks it."]
        #[doc = ""]
        #[doc = "# Safety"]
        #[doc = "1. The arguments meet the driver API's contract for the call (valid pointers and"]
        #[doc = "   handles, a current context where the call needs one), as for cudarc's binding."]
        #[allow(non_snake_case, clippy::too_many_arguments)] // the driver's names and arities
        #[inline]
        pub(crate) unsafe fn $name($($arg: $ty),*) -> CUresult {
            type F = unsafe extern "C" fn($($ty),*) -> CUresult;
            static FN: OnceLock<Result<F, CUresult>> = OnceLock::new();
            let f = FN.get_or_init(|| {
                resolve(stringify!($name)).map(|p| {
                    // SAFETY: `p` is the address of the driver's exported function of this name,
                    // whose C prototype (cuda.h) is `F`: cudarc's bindings, generated from that
                    // header, declare it with these argument types.
                    unsafe { std::mem::transmute::<*mut c_void, F>(p.as_ptr()) }
                })
            });
            match *f {
                // SAFETY: the caller meets the call's contract (this function's `# Safety`).
                Ok(f) => unsafe { f($($arg),*) },
                Err(code) => code,
            }
        }
    )*};
}

// The driver functions the crate calls, with cudarc's names and signatures (one definition each
// in cudarc 0.19's bindings for every CUDA version feature this crate offers).
driver_functions! {
    fn cuCtxGetCurrent(pctx: *mut CUcontext);
    fn cuCtxGetDevice(device: *mut CUdevice);
    fn cuCtxPopCurrent_v2(pctx: *mut CUcontext);
    fn cuCtxPushCurrent_v2(ctx: CUcontext);
    fn cuCtxSetCurrent(ctx: CUcontext);
    fn cuCtxSynchronize();
    fn cuDeviceCanAccessPeer(can_access_peer: *mut c_int, dev: CUdevice, peer_dev: CUdevice);
    fn cuDeviceGet(device: *mut CUdevice, ordinal: c_int);
    fn cuDeviceGetAttribute(pi: *mut c_int, attrib: CUdevice_attribute, dev: CUdevice);
    fn cuDeviceGetCount(count: *mut c_int);
    fn cuDeviceGetDefaultMemPool(pool_out: *mut CUmemoryPool, dev: CUdevice);
    fn cuDeviceGetMemPool(pool: *mut CUmemoryPool, dev: CUdevice);
    fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: CUdevice);
    fn cuDeviceGetPCIBusId(pci_bus_id: *mut c_char, len: c_int, dev: CUdevice);
    fn cuDeviceGetUuid_v2(uuid: *mut CUuuid, dev: CUdevice);
    fn cuDevicePrimaryCtxGetState(dev: CUdevice, flags: *mut c_uint, active: *mut c_int);
    fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice);
    fn cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice);
    fn cuDeviceSetMemPool(dev: CUdevice, pool: CUmemoryPool);
    fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice);
    fn cuDriverGetVersion(driver_version: *mut c_int);
    fn cuEventCreate(ph_event: *mut CUevent, flags: c_uint);
    fn cuEventDestroy_v2(h_event: CUevent);
    fn cuEventQuery(h_event: CUevent);
    fn cuEventRecord(h_event: CUevent, h_stream: CUstream);
    fn cuEventSynchronize(h_event: CUevent);
    fn cuGetErrorName(error: CUresult, p_str: *mut *const c_char);
    fn cuGetErrorString(error: CUresult, p_str: *mut *const c_char);
    fn cuGraphDestroy(h_graph: CUgraph);
    fn cuGraphExecDestroy(h_graph_exec: CUgraphExec);
    fn cuGraphInstantiateWithFlags(
        ph_graph_exec: *mut CUgraphExec,
        h_graph: CUgraph,
        flags: c_ulonglong,
    );
    fn cuGraphLaunch(h_graph_exec: CUgraphExec, h_stream: CUstream);
    fn cuInit(flags: c_uint);
    fn cuIpcCloseMemHandle(dptr: CUdeviceptr);
    fn cuIpcGetEventHandle(p_handle: *mut CUipcEventHandle, event: CUevent);
    fn cuIpcGetMemHandle(p_handle: *mut CUipcMemHandle, dptr: CUdeviceptr);
    fn cuIpcOpenEventHandle(ph_event: *mut CUevent, handle: CUipcEventHandle);
    fn cuIpcOpenMemHandle_v2(pdptr: *mut CUdeviceptr, handle: CUipcMemHandle, flags: c_uint);
    fn cuLaunchKernel(
        f: CUfunction,
        grid_dim_x: c_uint,
        grid_dim_y: c_uint,
        grid_dim_z: c_uint,
        block_dim_x: c_uint,
        block_dim_y: c_uint,
        block_dim_z: c_uint,
        shared_mem_bytes: c_uint,
        h_stream: CUstream,
        kernel_params: *mut *mut c_void,
        extra: *mut *mut c_void,
    );
    fn cuMemAddressFree(ptr: CUdeviceptr, size: usize);
    fn cuMemAddressReserve(
        ptr: *mut CUdeviceptr,
        size: usize,
        alignment: usize,
        addr: CUdeviceptr,
        flags: c_ulonglong,
    );
    fn cuMemAllocFromPoolAsync(
        dptr: *mut CUdeviceptr,
        bytesize: usize,
        pool: CUmemoryPool,
        h_stream: CUstream,
    );
    fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytesize: usize);
    fn cuMemCreate(
        handle: *mut CUmemGenericAllocationHandle,
        size: usize,
        prop: *const CUmemAllocationProp,
        flags: c_ulonglong,
    );
    fn cuMemExportToShareableHandle(
        shareable_handle: *mut c_void,
        handle: CUmemGenericAllocationHandle,
        handle_type: CUmemAllocationHandleType,
        flags: c_ulonglong,
    );
    fn cuMemFree_v2(dptr: CUdeviceptr);
    fn cuMemGetAddressRange_v2(pbase: *mut CUdeviceptr, psize: *mut usize, dptr: CUdeviceptr);
    fn cuMemGetAllocationGranularity(
        granularity: *mut usize,
        prop: *const CUmemAllocationProp,
        option: CUmemAllocationGranularity_flags,
    );
    fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize);
    fn cuMemHostGetDevicePointer_v2(pdptr: *mut CUdeviceptr, p: *mut c_void, flags: c_uint);
    fn cuMemHostRegister_v2(p: *mut c_void, bytesize: usize, flags: c_uint);
    fn cuMemHostUnregister(p: *mut c_void);
    fn cuMemImportFromShareableHandle(
        handle: *mut CUmemGenericAllocationHandle,
        os_handle: *mut c_void,
        sh_handle_type: CUmemAllocationHandleType,
    );
    fn cuMemMap(
        ptr: CUdeviceptr,
        size: usize,
        offset: usize,
        handle: CUmemGenericAllocationHandle,
        flags: c_ulonglong,
    );
    fn cuMemPoolCreate(pool: *mut CUmemoryPool, pool_props: *const CUmemPoolProps);
    fn cuMemPoolDestroy(pool: CUmemoryPool);
    fn cuMemPoolExportPointer(share_data_out: *mut CUmemPoolPtrExportData, ptr: CUdeviceptr);
    fn cuMemPoolExportToShareableHandle(
        handle_out: *mut c_void,
        pool: CUmemoryPool,
        handle_type: CUmemAllocationHandleType,
        flags: c_ulonglong,
    );
    fn cuMemPoolImportFromShareableHandle(
        pool_out: *mut CUmemoryPool,
        handle: *mut c_void,
        handle_type: CUmemAllocationHandleType,
        flags: c_ulonglong,
    );
    fn cuMemPoolImportPointer(
        ptr_out: *mut CUdeviceptr,
        pool: CUmemoryPool,
        share_data: *mut CUmemPoolPtrExportData,
    );
    fn cuMemPoolSetAccess(pool: CUmemoryPool, map: *const CUmemAccessDesc, count: usize);
    fn cuMemRelease(handle: CUmemGenericAllocationHandle);
    fn cuMemRetainAllocationHandle(handle: *mut CUmemGenericAllocationHandle, addr: *mut c_void);
    fn cuMemSetAccess(ptr: CUdeviceptr, size: usize, desc: *const CUmemAccessDesc, count: usize);
    fn cuMemUnmap(ptr: CUdeviceptr, size: usize);
    fn cuMemcpyDtoDAsync_v2(
        dst_device: CUdeviceptr,
        src_device: CUdeviceptr,
        byte_count: usize,
        h_stream: CUstream,
    );
    fn cuMemcpyDtoHAsync_v2(
        dst_host: *mut c_void,
        src_device: CUdeviceptr,
        byte_count: usize,
        h_stream: CUstream,
    );
    fn cuMemcpyDtoH_v2(dst_host: *mut c_void, src_device: CUdeviceptr, byte_count: usize);
    fn cuMemcpyHtoDAsync_v2(
        dst_device: CUdeviceptr,
        src_host: *const c_void,
        byte_count: usize,
        h_stream: CUstream,
    );
    fn cuMemcpyHtoD_v2(dst_device: CUdeviceptr, src_host: *const c_void, byte_count: usize);
    fn cuMemsetD32Async(dst_device: CUdeviceptr, ui: c_uint, n: usize, h_stream: CUstream);
    fn cuModuleGetFunction(hfunc: *mut CUfunction, hmod: CUmodule, name: *const c_char);
    fn cuModuleLoadData(module: *mut CUmodule, image: *const c_void);
    fn cuModuleUnload(hmod: CUmodule);
    fn cuPointerGetAttribute(data: *mut c_void, attribute: CUpointer_attribute, ptr: CUdeviceptr);
    fn cuPointerGetAttributes(
        num_attributes: c_uint,
        attributes: *mut CUpointer_attribute,
        data: *mut *mut c_void,
        ptr: CUdeviceptr,
    );
    fn cuStreamBeginCapture_v2(h_stream: CUstream, mode: CUstreamCaptureMode);
    fn cuStreamCreate(ph_stream: *mut CUstream, flags: c_uint);
    fn cuStreamDestroy_v2(h_stream: CUstream);
    fn cuStreamEndCapture(h_stream: CUstream, ph_graph: *mut CUgraph);
    fn cuStreamQuery(h_stream: CUstream);
    fn cuStreamSynchronize(h_stream: CUstream);
    fn cuStreamWaitEvent(h_stream: CUstream, h_event: CUevent, flags: c_uint);
    fn cuStreamWaitValue32_v2(
        stream: CUstream,
        addr: CUdeviceptr,
        value: cuuint32_t,
        flags: c_uint,
    );
    fn cuStreamWriteValue32_v2(
        stream: CUstream,
        addr: CUdeviceptr,
        value: cuuint32_t,
        flags: c_uint,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_soname_is_tried_first_and_every_name_once() {
        let names = driver_candidates();
        assert_eq!(names[0], "libcuda.so.1");
        assert_eq!(names[1], "libcuda.so");
        let mut unique = names.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), names.len(), "{names:?}");
        // cudarc's names are all still tried, for odd installs.
        for name in cudarc::get_lib_name_candidates("cuda") {
            assert!(names.contains(&name), "{name} is not tried");
        }
    }

    #[test]
    fn a_call_without_a_driver_library_is_an_error_not_a_panic() {
        if library().is_some() {
            return; // this machine has a driver: the no-library answer cannot be seen here
        }
        let mut v = 0;
        // SAFETY: `v` is a valid out-pointer for one int.
        let code = unsafe { cuDriverGetVersion(&mut v) };
        assert_eq!(code, CUresult::CUDA_ERROR_NOT_INITIALIZED);
    }
}
