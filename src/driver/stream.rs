use super::Context;
use crate::error::Result;
use crate::ffi::{check, sys};
use std::mem::MaybeUninit;
use std::sync::Arc;

/// A non-blocking stream (`cuStreamCreate` with `CU_STREAM_NON_BLOCKING`), destroyed on drop.
///
/// See <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html>.
#[derive(Debug)]
pub struct Stream {
    // Drop order: the stream is destroyed (in Drop) before `ctx` is released.
    raw: sys::CUstream,
    ctx: Arc<Context>,
}

// SAFETY: a CUstream is a driver handle usable from any thread while its context is current (every
// method enters it); the driver serialises work submitted to one stream.
unsafe impl Send for Stream {}
// SAFETY: as for Send.
unsafe impl Sync for Stream {}

impl Stream {
    /// Creates a non-blocking stream in `ctx`.
    ///
    /// # Errors
    /// [`crate::Error::Cuda`] naming `cuStreamCreate`.
    #[doc(alias = "cuStreamCreate")]
    pub fn new(ctx: &Arc<Context>) -> Result<Stream> {
        let _cur = ctx.enter()?;
        let mut raw = MaybeUninit::<sys::CUstream>::uninit();
        // SAFETY: context current (`_cur`); `raw` a valid out-pointer; flag is a defined stream
        // flag.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(
                raw.as_mut_ptr(),
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
            )
        })?;
        Ok(Stream {
            // SAFETY: written on success.
            raw: unsafe { raw.assume_init() },
            ctx: ctx.clone(),
        })
    }

    /// The context the stream belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// The raw `CUstream` for the user's own launches.
    pub fn as_raw(&self) -> sys::CUstream {
        self.raw
    }

    /// Blocks the calling thread until all work on the stream is done (`cuStreamSynchronize`).
    ///
    /// # Errors
    /// [`crate::Error::Cuda`] when queued work failed.
    #[doc(alias = "cuStreamSynchronize")]
    pub fn synchronize(&self) -> Result<()> {
        let _cur = self.ctx.enter()?;
        // SAFETY: context current (`_cur`); stream valid until drop.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(self.raw)
        })?;
        Ok(())
    }

    /// Whether all work on the stream is done (`cuStreamQuery`), without blocking.
    ///
    /// # Errors
    /// [`crate::Error::Cuda`] for codes other than success and `CUDA_ERROR_NOT_READY`.
    #[doc(alias = "cuStreamQuery")]
    pub fn is_idle(&self) -> Result<bool> {
        let _cur = self.ctx.enter()?;
        // SAFETY: context current (`_cur`); stream valid.
        let r = unsafe { sys::cuStreamQuery(self.raw) };
        if r == sys::CUresult::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        check("cuStreamQuery", r)?;
        Ok(true)
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let r = self.ctx.enter().and_then(|_cur| {
            // SAFETY: context current (`_cur`); the stream was created by this value and is
            // destroyed once. The driver lets queued work finish before releasing the stream's
            // resources.
            check("cuStreamDestroy_v2", unsafe {
                sys::cuStreamDestroy_v2(self.raw)
            })
            .map_err(Into::into)
        });
        if let Err(e) = r {
            tracing::warn!("{e}; the stream leaks until the context is torn down");
        }
    }
}

impl Stream {
    /// Enqueues a write of `value` to the 32-bit word at device address `addr`, after the work
    /// enqueued so far (`cuStreamWriteValue32_v2`, with a memory barrier).
    ///
    /// # Safety
    /// `addr` must be a 4-byte aligned device address of a word valid in this stream's context until
    /// the write has run (device memory, or host memory registered with the driver and mapped).
    pub(crate) unsafe fn write_value_u32(&self, addr: u64, value: u32) -> Result<()> {
        let _cur = self.ctx.enter()?;
        // SAFETY: context current (`_cur`); the caller guarantees `addr`.
        check("cuStreamWriteValue32_v2", unsafe {
            sys::cuStreamWriteValue32_v2(
                self.raw,
                addr,
                value,
                sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
            )
        })?;
        Ok(())
    }

    /// Makes later work on this stream wait until the 32-bit word at `addr` is at or after `value`
    /// in wrap-around order (`(int32)(*addr - value) >= 0`; `cuStreamWaitValue32_v2` with
    /// `CU_STREAM_WAIT_VALUE_GEQ`). The calling thread does not block.
    ///
    /// # Safety
    /// As [`Stream::write_value_u32`], for as long as the wait may run.
    pub(crate) unsafe fn wait_value_u32(&self, addr: u64, value: u32) -> Result<()> {
        let _cur = self.ctx.enter()?;
        // SAFETY: context current (`_cur`); the caller guarantees `addr`.
        check("cuStreamWaitValue32_v2", unsafe {
            sys::cuStreamWaitValue32_v2(
                self.raw,
                addr,
                value,
                sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
            )
        })?;
        Ok(())
    }
}
