use super::{Context, Stream};
use crate::error::{Error, Result};
use crate::ffi::{check, sys};
use std::mem::MaybeUninit;
use std::sync::Arc;

/// Device memory that can be read and written through the driver: a [`DeviceBuffer`], an imported
/// buffer, or a VMM mapping. Offsets and lengths are in bytes.
pub trait DeviceMemory {
    /// Device address of the first byte (a `CUdeviceptr`), valid in [`DeviceMemory::context`].
    fn device_ptr(&self) -> u64;
    /// Length in bytes.
    fn len(&self) -> usize;
    /// The context in which [`DeviceMemory::device_ptr`] is valid.
    fn context(&self) -> &Arc<Context>;

    /// True when the length is zero.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copies `src` to bytes `offset..offset + src.len()` and waits for the copy
    /// (`cuMemcpyHtoD_v2`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the range leaves the buffer; [`Error::Cuda`] from the copy.
    #[doc(alias = "cuMemcpyHtoD")]
    fn copy_from_host(&self, offset: usize, src: &[u8]) -> Result<()> {
        check_range(offset, src.len(), self.len())?;
        let _cur = self.context().enter()?;
        // SAFETY: context current (`_cur`); the destination range lies inside this allocation
        // (checked above); `src` is valid for `src.len()` bytes. The copy is synchronous.
        check("cuMemcpyHtoD_v2", unsafe {
            sys::cuMemcpyHtoD_v2(
                self.device_ptr() + offset as u64,
                src.as_ptr().cast(),
                src.len(),
            )
        })?;
        Ok(())
    }

    /// Copies bytes `offset..offset + dst.len()` into `dst` and waits (`cuMemcpyDtoH_v2`). The copy
    /// is ordered after all work in the context's legacy default stream, not after other streams:
    /// synchronise the stream that wrote the data first.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the range leaves the buffer; [`Error::Cuda`] from the copy.
    #[doc(alias = "cuMemcpyDtoH")]
    fn copy_to_host(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        check_range(offset, dst.len(), self.len())?;
        let _cur = self.context().enter()?;
        // SAFETY: context current (`_cur`); the source range lies inside this allocation; `dst` is
        // valid for writes of `dst.len()` bytes. The copy is synchronous.
        check("cuMemcpyDtoH_v2", unsafe {
            sys::cuMemcpyDtoH_v2(
                dst.as_mut_ptr().cast(),
                self.device_ptr() + offset as u64,
                dst.len(),
            )
        })?;
        Ok(())
    }

    /// Enqueues on `stream` a copy of `src` to bytes `offset..offset + src.len()`
    /// (`cuMemcpyHtoDAsync_v2`): ordered after the work enqueued before it on `stream`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the range leaves the buffer; [`Error::Cuda`] from the copy.
    ///
    /// # Safety
    /// `src` stays valid and unchanged until the copy completed (`stream` synchronised, or an
    /// event recorded after it waited for): from page-locked memory the copy runs after this
    /// function returns. (From pageable memory the driver stages `src` before returning, but
    /// whether memory is page-locked is not seen in a `&[u8]`.)
    #[doc(alias = "cuMemcpyHtoDAsync")]
    unsafe fn copy_from_host_on(&self, offset: usize, src: &[u8], stream: &Stream) -> Result<()> {
        check_range(offset, src.len(), self.len())?;
        let _cur = self.context().enter()?;
        // SAFETY: context current (`_cur`); the destination range lies inside this allocation
        // (checked above); `src` is valid for `src.len()` bytes until the copy completed (the
        // caller's obligation); the stream can address this memory (as `memset_u32_async`).
        check("cuMemcpyHtoDAsync_v2", unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                self.device_ptr() + offset as u64,
                src.as_ptr().cast(),
                src.len(),
                stream.as_raw(),
            )
        })?;
        Ok(())
    }

    /// Copies bytes `offset..offset + dst.len()` into `dst` after the work enqueued so far on
    /// `stream`, and waits for `stream` (`cuMemcpyDtoHAsync_v2`, `cuStreamSynchronize`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the range leaves the buffer; [`Error::Cuda`] from the copy
    /// or from the stream (an earlier kernel's fault shows here).
    #[doc(alias = "cuMemcpyDtoHAsync")]
    fn copy_to_host_on(&self, offset: usize, dst: &mut [u8], stream: &Stream) -> Result<()> {
        check_range(offset, dst.len(), self.len())?;
        {
            let _cur = self.context().enter()?;
            // SAFETY: context current (`_cur`); the source range lies inside this allocation;
            // `dst` is valid for writes of `dst.len()` bytes until the stream is synchronised
            // below, before this function returns.
            check("cuMemcpyDtoHAsync_v2", unsafe {
                sys::cuMemcpyDtoHAsync_v2(
                    dst.as_mut_ptr().cast(),
                    self.device_ptr() + offset as u64,
                    dst.len(),
                    stream.as_raw(),
                )
            })?;
        }
        stream.synchronize()
    }

    /// Enqueues on `stream` a fill of the whole buffer with the 32-bit `value`
    /// (`cuMemsetD32Async`). The length must be a multiple of 4 bytes.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a length not a multiple of 4; [`Error::Cuda`].
    #[doc(alias = "cuMemsetD32Async")]
    fn memset_u32_async(&self, value: u32, stream: &Stream) -> Result<()> {
        if !self.len().is_multiple_of(4) {
            return Err(Error::InvalidArgument(format!(
                "memset_u32 needs a length multiple of 4 bytes, got {}",
                self.len()
            )));
        }
        let _cur = self.context().enter()?;
        // SAFETY: context current (`_cur`); `len / 4` words from `device_ptr` lie inside the
        // allocation; the stream belongs to a context that can address this memory (same context or
        // peer/IPC mapping).
        check("cuMemsetD32Async", unsafe {
            sys::cuMemsetD32Async(self.device_ptr(), value, self.len() / 4, stream.as_raw())
        })?;
        Ok(())
    }
}

pub(crate) fn check_range(offset: usize, len: usize, total: usize) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= total => Ok(()),
        _ => Err(Error::InvalidArgument(format!(
            "range {offset}..{offset}+{len} lies outside a buffer of {}",
            crate::error::bytes(total)
        ))),
    }
}

/// One `cuMemAlloc` allocation, freed when the last reference goes. Shared between a
/// [`DeviceBuffer`] and any self-import of it, so a self-import never dangles.
#[derive(Debug)]
pub(crate) struct Allocation {
    // Drop order: the memory is freed (in Drop) before `ctx` is released.
    pub(crate) ptr: sys::CUdeviceptr,
    pub(crate) len: usize,
    pub(crate) ctx: Arc<Context>,
}

impl Drop for Allocation {
    fn drop(&mut self) {
        let r = self.ctx.enter().and_then(|_cur| {
            // SAFETY: context current (`_cur`); `ptr` came from cuMemAlloc_v2 and is freed once,
            // here, when the last holder (buffer or self-import) is gone.
            check("cuMemFree_v2", unsafe { sys::cuMemFree_v2(self.ptr) }).map_err(Into::into)
        });
        if let Err(e) = r {
            tracing::warn!(
                "{e}; the allocation of {} stays until the context is torn down",
                crate::error::bytes(self.len)
            );
        }
    }
}

/// Device memory from `cuMemAlloc_v2`: the kind legacy IPC can export.
///
/// Legacy IPC handles name the whole allocation, so an importer of any part can read all of it:
/// allocate what you share apart from private data. `len` is in bytes. Freed on drop, once no
/// self-import still refers to it (importers in other processes keep their own mapping; the driver
/// leaves their contents undefined once it is freed here, so keep it until they released it).
///
/// See <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html>.
#[derive(Debug, Clone)]
pub struct DeviceBuffer {
    pub(crate) alloc: Arc<Allocation>,
}

impl DeviceBuffer {
    /// Allocates `len` bytes (`cuMemAlloc_v2`); contents are uninitialised.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for `len == 0`; [`Error::Cuda`] with `CUDA_ERROR_OUT_OF_MEMORY`.
    #[doc(alias = "cuMemAlloc")]
    pub fn new(ctx: &Arc<Context>, len: usize) -> Result<DeviceBuffer> {
        if len == 0 {
            return Err(Error::InvalidArgument(
                "a device buffer needs at least 1 byte".into(),
            ));
        }
        let _cur = ctx.enter()?;
        let mut ptr = MaybeUninit::<sys::CUdeviceptr>::uninit();
        // SAFETY: context current (`_cur`); `ptr` a valid out-pointer.
        check("cuMemAlloc_v2", unsafe {
            sys::cuMemAlloc_v2(ptr.as_mut_ptr(), len)
        })?;
        Ok(DeviceBuffer {
            alloc: Arc::new(Allocation {
                // SAFETY: written on success.
                ptr: unsafe { ptr.assume_init() },
                len,
                ctx: ctx.clone(),
            }),
        })
    }
}

impl DeviceMemory for DeviceBuffer {
    fn device_ptr(&self) -> u64 {
        self.alloc.ptr
    }
    fn len(&self) -> usize {
        self.alloc.len
    }
    fn context(&self) -> &Arc<Context> {
        &self.alloc.ctx
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_outside_the_buffer_are_rejected_without_overflow() {
        assert!(check_range(0, 10, 10).is_ok());
        assert!(check_range(1, 10, 10).is_err());
        assert!(check_range(usize::MAX, 2, 10).is_err());
    }
}

/// Host memory page-locked and mapped for the device (`cuMemHostRegister_v2` with
/// `PORTABLE | DEVICEMAP`), unregistered on drop. The memory itself belongs to the caller, who must
/// keep it mapped until this drops and every GPU operation on it has run.
#[derive(Debug)]
pub(crate) struct HostRegistration {
    ctx: Arc<Context>,
    ptr: *mut u8,
    /// The device address of `ptr` in `ctx` (`cuMemHostGetDevicePointer_v2`).
    pub(crate) device_ptr: u64,
}

// SAFETY: the registration is process-wide driver state; the raw pointer is only passed back to
// the driver.
unsafe impl Send for HostRegistration {}
// SAFETY: as for Send.
unsafe impl Sync for HostRegistration {}

impl HostRegistration {
    /// Registers `len` bytes at `ptr` (both page aligned).
    ///
    /// # Safety
    /// `ptr..ptr + len` must be mapped memory that stays mapped until the registration drops.
    pub(crate) unsafe fn new(ctx: &Arc<Context>, ptr: *mut u8, len: usize) -> Result<Self> {
        let _cur = ctx.enter()?;
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: context current (`_cur`); the caller guarantees the range is mapped.
        check("cuMemHostRegister_v2", unsafe {
            sys::cuMemHostRegister_v2(ptr.cast(), len, flags)
        })?;
        // Unregisters on drop if the query below fails.
        let mut reg = HostRegistration {
            ctx: ctx.clone(),
            ptr,
            device_ptr: 0,
        };
        let mut d = MaybeUninit::<sys::CUdeviceptr>::uninit();
        // SAFETY: context current (`_cur`); `ptr` was registered with DEVICEMAP just above.
        check("cuMemHostGetDevicePointer_v2", unsafe {
            sys::cuMemHostGetDevicePointer_v2(d.as_mut_ptr(), ptr.cast(), 0)
        })?;
        // SAFETY: written on success.
        reg.device_ptr = unsafe { d.assume_init() };
        Ok(reg)
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        let r = self.ctx.enter().and_then(|_cur| {
            // SAFETY: context current (`_cur`); `ptr` was registered by this value and is
            // unregistered once.
            check("cuMemHostUnregister", unsafe {
                sys::cuMemHostUnregister(self.ptr.cast())
            })
            .map_err(Into::into)
        });
        if let Err(e) = r {
            tracing::warn!("{e}; a host page stays locked until exit");
        }
    }
}
