//! Frames as tensors: DLPack capsules (through `dlpark`) and `__cuda_array_interface__` (v3).
//!
//! A frame exports as a one-dimensional `uint8` tensor of the whole buffer; reshape and view it on
//! the consumer's side (`torch.from_dlpack(frame).view(torch.float32).reshape(h, w)`). A capsule
//! made from a received frame owns an `Arc` of it, so the frame stays held until the tensor is
//! freed, whenever the Python `Frame` is released.
//!
//! Streams: the frame is ready on the consumer's (or, for a write frame, the producer's) stream.
//! `__dlpack__(stream=s)` makes `s` wait for it on the GPU (`Frame::ready_on_raw`: an event
//! recorded on the frame's stream, `cuStreamWaitEvent` on `s`); `stream=None` does so for the legacy
//! default stream, as the protocol says; `stream=-1` asks for no ordering. The other direction is
//! ordered too: when the tensor is freed, the capsule's hold orders the release after the work
//! enqueued on `s` by then (`Frame::release_after_raw`) before it ends the hold; for a write frame,
//! the caller orders the publish after `s` ([`Export::target`]).

use cuda_ipc::channel::owned::OwnedFrame;
use dlpark::ffi::{DLDataType, DLDevice, DLDeviceType, DLManagedTensor, DLManagedTensorVersioned};
use dlpark::metadata::Dynamic;
use dlpark::python::{CudaStreamRequest, DlpackExporter, ExportRequest, export_dlpack};
use dlpark::{DlpackFlags, Managed, ManagedTensorBase};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::sync::{Arc, Mutex};

/// `kDLCUDA`.
pub(crate) const KDL_CUDA: i32 = 2;

/// What a capsule keeps alive.
pub(crate) enum Hold {
    /// A received frame: its hold ends when the last `Arc` goes.
    Frame(FrameHold),
    /// Nothing (a write frame's buffer, valid until it is published or abandoned; a tensor-set
    /// writer's buffer, valid while the writer lives).
    None,
    /// What keeps the memory mapped (a tensor-set reader, whose mappings live as long as it).
    Owner(Arc<dyn std::any::Any + Send + Sync>),
}

/// A capsule's share of a received frame's hold: on drop (the tensor freed), the release is
/// ordered after the work enqueued by then on `release_after`, the stream the tensor's library
/// named in `__dlpack__`, and then this `Arc` of the frame goes.
pub(crate) struct FrameHold {
    pub frame: Arc<OwnedFrame>,
    /// A raw `CUstream` of the consumer's context (or a default-stream sentinel); `None` when the
    /// library asked for no ordering or named the frame's own stream.
    pub release_after: Option<usize>,
}

impl Drop for FrameHold {
    fn drop(&mut self) {
        let Some(s) = self.release_after else {
            return;
        };
        let frame = self.frame.frame();
        // SAFETY: `s` is the stream the DLPack consumer passed to `__dlpack__`, which the protocol
        // requires to be a valid stream of this device; it must outlive the tensor (documented in
        // python/README.md: PyTorch's and CuPy's pooled streams and the default streams always do).
        if let Err(e) = unsafe { frame.release_after_raw(s as _) } {
            if matches!(e, cuda_ipc::Error::ForkedChild { .. }) {
                // A forked child's copy of its parent's frame: nothing of it is this process's.
                return;
            }
            // Without the ordering the producer could overwrite the buffer under work still queued
            // on `s`: wait for the context's work on the host instead.
            eprintln!(
                "cuda_ipc: ordering a frame's release after a tensor's stream failed ({e}); synchronising"
            );
            if let Err(e) = self
                .frame
                .consumer()
                .context()
                .and_then(|c| c.synchronize())
            {
                eprintln!("cuda_ipc: synchronising the consumer's context failed: {e}");
            }
        }
    }
}

/// A frame's element type: bytes.
pub(crate) const BYTES: DLDataType = DLDataType::of::<u8>();

/// One export of a frame, or of a tensor set's allocation as one typed base.
pub(crate) struct Export {
    pub hold: Hold,
    pub ptr: u64,
    pub nbytes: usize,
    /// The element type: `uint8` for a frame (a one-dimensional tensor of `nbytes` elements);
    /// a tensor set's dtype for its typed base (`nbytes / element size` elements, `nbytes` a
    /// whole number of them).
    pub dtype: DLDataType,
    /// The CUDA ordinal (`kDLCUDA`), or -1 for host memory (`kDLCPU`, device 0).
    pub device: i32,
    /// The raw stream the data is ready on.
    pub ready_on: usize,
    /// The frame whose stream the data is ready on (`None` for a write frame, ready on the
    /// producer's stream with nothing pending there for it).
    pub frame: Option<Arc<OwnedFrame>>,
    /// The stream the DLPack consumer named (resolved from `stream=`; `None` for no ordering or
    /// the data's own stream), set by the export: the caller orders the publish after it.
    pub target: Mutex<Option<usize>>,
}

impl Export {
    pub(crate) fn export(
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
        let elem = (usize::from(self.dtype.bits) * usize::from(self.dtype.lanes)).div_ceil(8);
        let len = i64::try_from(self.nbytes / elem.max(1))
            .map_err(|_| pyo3::exceptions::PyOverflowError::new_err("buffer too large"))?;
        let hold = match &self.hold {
            Hold::Frame(h) => Hold::Frame(FrameHold {
                frame: h.frame.clone(),
                release_after: *self.target.lock().unwrap_or_else(|p| p.into_inner()),
            }),
            Hold::None => Hold::None,
            Hold::Owner(o) => Hold::Owner(o.clone()),
        };
        let mut init = Dynamic::compact([len])
            .initialize_as::<M>(Box::new(hold))
            .map_err(|e| pyo3::exceptions::PyMemoryError::new_err(e.to_string()))?;
        init.set_data(self.ptr as *mut std::ffi::c_void)
            .set_device(self.dl_device())
            .set_dtype(self.dtype);
        // The data pointer is mapped for as long as the context's hold keeps its owner (the
        // consumer of a frame, a tensor-set reader) alive; for `Hold::None` (a write frame, a
        // writer's buffer) while the producer or writer lives, which the caller documents.
        // SAFETY: pointer valid as above; shape and strides written by `Dynamic::compact`; no
        // flags (writable, not a copy) is true of a view of shared memory.
        let tensor = unsafe { init.finish() };
        Ok(tensor)
    }

    fn dl_device(&self) -> DLDevice {
        if self.device < 0 {
            return DLDevice {
                device_type: DLDeviceType::CPU,
                device_id: 0,
            };
        }
        DLDevice {
            device_type: DLDeviceType::CUDA,
            device_id: self.device,
        }
    }
}

// SAFETY (of the `Send` the capsule context needs): `Hold` holds an `Arc<OwnedFrame>`, which is
// `Send` because the Rust consumer is `Sync` and `Send`, and a raw stream number; nothing else.
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
        *self.target.lock().unwrap_or_else(|p| p.into_inner()) = Some(target);
        let Some(frame) = &self.frame else {
            return Ok(());
        };
        // SAFETY: `target` is the stream the DLPack consumer passed, which the protocol requires to
        // be a valid stream of this device, or a default-stream sentinel.
        unsafe { frame.frame().ready_on_raw(target as _) }.map_err(|e| crate::errors::to_py(py, &e))
    }

    fn export_legacy(&self, _py: Python<'_>) -> PyResult<Managed<DLManagedTensor>> {
        self.managed()
    }

    fn export_versioned(&self, _py: Python<'_>) -> PyResult<Managed<DLManagedTensorVersioned>> {
        self.managed()
    }
}

/// `__cuda_array_interface__` version 3: one-dimensional bytes, ready on `stream`.
pub(crate) fn cuda_array_interface<'py>(
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
