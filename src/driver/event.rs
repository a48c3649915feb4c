use super::{Context, Stream};
use crate::error::Result;
use crate::ffi::{check, sys};
use std::mem::MaybeUninit;
use std::sync::Arc;

/// A CUDA event (`cuEventCreate`), destroyed on drop.
///
/// Interprocess events (the flags `CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING`) are made by
/// [`crate::ipc::IpcEvent`], which wraps this type.
///
/// See <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html>.
#[derive(Debug)]
pub struct Event {
    // Drop order: the event is destroyed (in Drop) before `ctx` is released.
    raw: sys::CUevent,
    ctx: Arc<Context>,
}

// SAFETY: a CUevent is a driver handle usable from any thread while its context is current (every
// method enters it first); the driver synchronises record/query/wait.
unsafe impl Send for Event {}
// SAFETY: as for Send.
unsafe impl Sync for Event {}

impl Event {
    /// Creates an event with timing disabled (`CU_EVENT_DISABLE_TIMING`, the cheapest kind).
    ///
    /// # Errors
    /// [`crate::Error::Cuda`] naming `cuEventCreate`.
    #[doc(alias = "cuEventCreate")]
    pub fn new(ctx: &Arc<Context>) -> Result<Event> {
        Self::with_flags(ctx, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
    }

    pub(crate) fn with_flags(ctx: &Arc<Context>, flags: u32) -> Result<Event> {
        let _cur = ctx.enter()?;
        let mut raw = MaybeUninit::<sys::CUevent>::uninit();
        // SAFETY: context current (`_cur`); `raw` a valid out-pointer; `flags` a combination of
        // CUevent_flags.
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(raw.as_mut_ptr(), flags)
        })?;
        Ok(Event {
            // SAFETY: written on success.
            raw: unsafe { raw.assume_init() },
            ctx: ctx.clone(),
        })
    }

    /// Wraps an event handle this value will own and destroy.
    ///
    /// # Safety
    /// 1. `raw` is a valid event in `ctx`, and nothing else destroys it.
    pub(crate) unsafe fn from_raw(ctx: &Arc<Context>, raw: sys::CUevent) -> Event {
        Event {
            raw,
            ctx: ctx.clone(),
        }
    }

    /// The context the event belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// The raw `CUevent`.
    pub fn as_raw(&self) -> sys::CUevent {
        self.raw
    }

    /// Captures the work queued so far on `stream` (`cuEventRecord`). Queries and waits then refer
    /// to this record.
    ///
    /// # Errors
    /// [`crate::Error::Cuda`] naming `cuEventRecord`.
    #[doc(alias = "cuEventRecord")]
    pub fn record(&self, stream: &Stream) -> Result<()> {
        let _cur = self.ctx.enter()?;
        // SAFETY: context current (`_cur`); event and stream valid for the call.
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(self.raw, stream.as_raw())
        })?;
        Ok(())
    }

    /// Makes stream `after` wait on the GPU for the work enqueued so far on stream `before`: this
    /// event recorded on `before` (`cuEventRecord`), then `cuStreamWaitEvent` on `after`. The
    /// calling thread does not block. The event may be recorded again at once: a wait uses the
    /// record the event had when the wait was enqueued. Two threads ordering through one event at
    /// the same time may cross their records; callers that share an event serialise (a lock).
    ///
    /// # Errors
    /// [`crate::Error::Cuda`] naming `cuEventRecord` (for instance `before` is a stream of another
    /// context) or `cuStreamWaitEvent`.
    ///
    /// # Safety
    /// 1. `before` is a live stream of this event's context, or null or one of the sentinels
    ///    `CU_STREAM_LEGACY` (`0x1`) and `CU_STREAM_PER_THREAD` (`0x2`), which name the default
    ///    streams of this event's context.
    /// 2. `after` is a live stream of any context (the driver allows an event of another context
    ///    or device), or one of the same sentinels, for the duration of the call.
    ///
    /// See <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html> (`cuStreamWaitEvent`).
    #[doc(alias = "cuStreamWaitEvent")]
    pub unsafe fn order_raw(&self, before: sys::CUstream, after: sys::CUstream) -> Result<()> {
        let _cur = self.ctx.enter()?;
        // SAFETY: context current (`_cur`), so the sentinels name its default streams; the event is
        // valid until drop; the caller guarantees `before` (obligation 1).
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(self.raw, before)
        })?;
        // SAFETY: the event was recorded above; the caller guarantees `after` (obligation 2).
        check("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(after, self.raw, 0)
        })?;
        Ok(())
    }

    /// Whether the last record has completed (`cuEventQuery`); true for a never-recorded event.
    ///
    /// # Errors
    /// [`crate::Error::Cuda`] for codes other than success and `CUDA_ERROR_NOT_READY`.
    #[doc(alias = "cuEventQuery")]
    pub fn is_complete(&self) -> Result<bool> {
        let _cur = self.ctx.enter()?;
        // SAFETY: context current (`_cur`); event valid.
        let r = unsafe { sys::cuEventQuery(self.raw) };
        if r == sys::CUresult::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        check("cuEventQuery", r)?;
        Ok(true)
    }

    /// Blocks the calling thread until the last record completes (`cuEventSynchronize`).
    ///
    /// # Errors
    /// [`crate::Error::Cuda`] when the recorded work failed.
    #[doc(alias = "cuEventSynchronize")]
    pub fn synchronize(&self) -> Result<()> {
        let _cur = self.ctx.enter()?;
        // SAFETY: context current (`_cur`); event valid.
        check("cuEventSynchronize", unsafe {
            sys::cuEventSynchronize(self.raw)
        })?;
        Ok(())
    }
}

// `Stream`'s method that names `Event` lives here, beside `Event`, so that `stream.rs` does not
// import this file (events are recorded on streams: this file builds on `stream.rs`).
impl Stream {
    /// Makes later work on this stream wait until `event`'s last record completes
    /// (`cuStreamWaitEvent`). The calling thread does not block.
    ///
    /// `event` may belong to another context or, for an event opened from an `IpcEventHandle`,
    /// have been recorded in another process.
    ///
    /// # Errors
    /// [`crate::Error::Cuda`] naming `cuStreamWaitEvent`.
    #[doc(alias = "cuStreamWaitEvent")]
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        let _cur = self.context().enter()?;
        // SAFETY: context current (`_cur`); stream and event valid for the duration of the call.
        check("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(self.as_raw(), event.as_raw(), 0)
        })?;
        Ok(())
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let r = self.ctx.enter().and_then(|_cur| {
            // SAFETY: context current (`_cur`); this value owns the event and destroys it once.
            // Destroying an event with a pending record is allowed (the driver releases it on
            // completion).
            check("cuEventDestroy_v2", unsafe {
                sys::cuEventDestroy_v2(self.raw)
            })
            .map_err(Into::into)
        });
        if let Err(e) = r {
            tracing::warn!("{e}; the event leaks until the context is torn down");
        }
    }
}
