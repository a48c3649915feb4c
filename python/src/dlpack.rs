//! Frames as tensors: DLPack capsules (through `dlpark`) and `__cuda_array_interface__` (v3).
//!
//! A frame exports as a one-dimensional `uint8` tensor of the whole buffer; reshape and view it on
//! the consumer's side (`torch.from_dlpack(frame).view(torch.float32).reshape(h, w)`). A capsule
//! made from a received frame owns an `Arc` of it, so the frame stays held until the tensor is
//! freed, whenever the Python `Frame` is released.
//!
//! Streams: the frame is ready on the consumer's (or, for a write frame, the producer's) stream.
//! `__dlpack__(stream=s)` makes `s` wait for it on the GPU (an event recorded on the frame's stream,
//! `cuStreamWaitEvent` on `s`); `stream=None` does so for the legacy default stream, as the
//! protocol says; `stream=-1` asks for no ordering. The release at the end of the hold is recorded on
//! the frame's stream only: work enqueued on `s` is not ordered before it.

use cuda_ipc::channel::owned::OwnedFrame;
use cuda_ipc::driver::{Context, Event};
use dlpark::ffi::{DLDataType, DLDevice, DLDeviceType, DLManagedTensor, DLManagedTensorVersioned};
use dlpark::metadata::Dynamic;
use dlpark::python::{CudaStreamRequest, DlpackExporter, ExportRequest, export_dlpack};
use dlpark::{DlpackFlags, Managed, ManagedTensorBase};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::sync::Arc;

/// `kDLCUDA`.
pub const KDL_CUDA: i32 = 2;

/// What a capsule keeps alive.
#[derive(Clone)]
pub enum Hold {
    /// A received frame: its hold ends when the last `Arc` goes.
    Frame(#[expect(dead_code, reason = "held for its Drop, which ends the hold")] Arc<OwnedFrame>),
    /// Nothing (a write frame's buffer, valid until it is published or abandoned).
    None,
}

/// One export of a frame.
pub struct Export {
    pub hold: Hold,
    pub ptr: u64,
    pub nbytes: usize,
    pub device: i32,
    /// The raw stream the data is ready on.
    pub ready_on: usize,
    /// The context of that stream, for the event that orders the consumer's stream after it.
    pub ctx: Option<Arc<Context>>,
}

impl Export {
    pub fn export(
        &self,
        py: Python<'_>,
        stream: Option<&Bound<'_, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(u32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        let request = ExportRequest::parse(stream, max_version, dl_device, copy)?;
        export_dlpack(self, py, request)
    }

    fn managed<M: ManagedTensorBase>(&self) -> PyResult<Managed<M>> {
        let len = i64::try_from(self.nbytes)
            .map_err(|_| pyo3::exceptions::PyOverflowError::new_err("buffer too large"))?;
        let mut init = Dynamic::compact([len])
            .initialize_as::<M>(Box::new(self.hold.clone()))
            .map_err(|e| pyo3::exceptions::PyMemoryError::new_err(e.to_string()))?;
        init.set_data(self.ptr as *mut std::ffi::c_void)
            .set_device(self.dl_device())
            .set_dtype(DLDataType::of::<u8>());
        // SAFETY: the data pointer is the frame's buffer, mapped in this process for as long as
        // the consumer (kept by the `Arc<OwnedFrame>` in the context) lives; the shape and strides
        // were written by `Dynamic::compact`; the flags (none) say it is writable and not a copy,
        // which holds for a view of the pool buffer. For a write frame (`Hold::None`) the
        // buffer stays valid while its producer lives, which the caller documents.
        Ok(unsafe { init.finish() })
    }

    fn dl_device(&self) -> DLDevice {
        DLDevice {
            device_type: DLDeviceType::CUDA,
            device_id: self.device,
        }
    }
}

// SAFETY (of the `Send` the capsule context needs): `Hold` holds an `Arc<OwnedFrame>`, which is
// `Send` because the Rust consumer is `Sync` and `Send`; nothing else.
const _: () = {
    const fn send<T: Send>() {}
    send::<Hold>();
};

impl DlpackExporter for Export {
    fn device(&self) -> DLDevice {
        self.dl_device()
    }

    fn flags(&self) -> DlpackFlags {
        DlpackFlags::empty()
    }

    fn prepare_export(&self, py: Python<'_>, request: &ExportRequest<'_>) -> PyResult<()> {
        // CUDA's stream sentinels: 1 the legacy default stream, 2 the per-thread one.
        let target = match request.cuda_stream()? {
            CudaStreamRequest::NoSync => return Ok(()),
            CudaStreamRequest::Omitted | CudaStreamRequest::LegacyDefault => 1,
            CudaStreamRequest::PerThreadDefault => 2,
            CudaStreamRequest::Pointer(p) => p,
        };
        if target == self.ready_on {
            return Ok(());
        }
        let Some(ctx) = &self.ctx else {
            return Ok(());
        };
        order_after(ctx, self.ready_on, target).map_err(|e| crate::errors::to_py(py, &e))
    }

    fn export_legacy(&self, _py: Python<'_>) -> PyResult<Managed<DLManagedTensor>> {
        self.managed()
    }

    fn export_versioned(&self, _py: Python<'_>) -> PyResult<Managed<DLManagedTensorVersioned>> {
        self.managed()
    }
}

/// Makes stream `target` wait on the GPU for the work enqueued so far on `ready_on` (both raw
/// `CUstream`s of `ctx`'s device): an event recorded on `ready_on`, `cuStreamWaitEvent` on
/// `target`. The event may be destroyed right after: the wait uses the state it had when enqueued.
fn order_after(ctx: &Arc<Context>, ready_on: usize, target: usize) -> cuda_ipc::Result<()> {
    use cudarc::driver::sys;
    let ev = Event::new(ctx)?;
    // SAFETY: `ev` is a live event of `ctx`; `ready_on` is the frame's stream, kept alive by the
    // consumer that `Export::hold` references; the driver checks the handles' context.
    let r = unsafe { sys::cuEventRecord(ev.as_raw(), ready_on as sys::CUstream) };
    check("cuEventRecord", r)?;
    // SAFETY: `target` is the stream the DLPack consumer passed, which the protocol requires to be
    // a valid stream of this device; `ev` was recorded above.
    let r = unsafe { sys::cuStreamWaitEvent(target as sys::CUstream, ev.as_raw(), 0) };
    check("cuStreamWaitEvent", r)
}

fn check(call: &'static str, r: cudarc::driver::sys::CUresult) -> cuda_ipc::Result<()> {
    if r == cudarc::driver::sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(cuda_ipc::CudaError {
            call,
            code: r as u32,
        }
        .into())
    }
}

/// `__cuda_array_interface__` version 3: one-dimensional bytes, ready on `stream`.
pub fn cuda_array_interface<'py>(
    py: Python<'py>,
    ptr: u64,
    nbytes: usize,
    read_only: bool,
    stream: usize,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("shape", (nbytes,))?;
    d.set_item("typestr", "|u1")?;
    d.set_item("data", (ptr, read_only))?;
    d.set_item("strides", py.None())?;
    d.set_item("version", 3)?;
    d.set_item("stream", stream)?;
    Ok(d)
}
