//! Where a frame's buffer is, as both frame classes read it from the library's one view
//! (`cuda_ipc::channel::FrameBuffer`).

use crate::errors;
use crate::util::{GPU_FRAME, range_arg};
use cuda_ipc::channel::FrameBuffer;
use cuda_ipc::driver::DeviceMemory;
use pyo3::prelude::*;

/// Where a GPU frame's buffer is; a host frame has none.
#[derive(Clone, Copy)]
pub(crate) struct DeviceView {
    pub(crate) ptr: u64,
    /// The raw stream the frame is written (write frame) or ready (received frame) on.
    pub(crate) stream: usize,
    pub(crate) device: i32,
}

impl DeviceView {
    /// A frame's length in bytes and, on a GPU channel, where its buffer is: both frame classes
    /// read their buffer through the library's one view ([`FrameBuffer`]).
    pub(crate) fn of<B: DeviceMemory>(view: FrameBuffer<'_, B>) -> (usize, Option<DeviceView>) {
        let gpu = match (view.device(), view.stream()) {
            (Ok(buffer), Ok(stream)) => Some(DeviceView {
                ptr: buffer.device_ptr(),
                stream: stream.as_raw() as usize,
                device: buffer.context().device().ordinal() as i32,
            }),
            _ => None,
        };
        (view.len(), gpu)
    }
}

/// A frame's buffer as both Python frame classes hold it, made once from the library's view: its
/// length, and where it is on a GPU (`None`: host memory). Every accessor of the other kind raises
/// `NotSupported` here, in one place.
pub(crate) struct Buffer {
    /// The buffer's length in bytes.
    pub(crate) nbytes: usize,
    gpu: Option<DeviceView>,
    /// What a GPU accessor of a host frame raises (it names the class's host accessors).
    host_text: &'static str,
}

impl Buffer {
    /// The buffer of a frame whose view is `view`; `host_text` is the message of a GPU accessor
    /// asked of a host frame.
    pub(crate) fn of<B: DeviceMemory>(view: FrameBuffer<'_, B>, host_text: &'static str) -> Buffer {
        let (nbytes, gpu) = DeviceView::of(view);
        Buffer {
            nbytes,
            gpu,
            host_text,
        }
    }

    /// Whether the buffer is host memory.
    pub(crate) fn is_host(&self) -> bool {
        self.gpu.is_none()
    }

    /// Where the buffer is on its GPU; `None` for host memory.
    pub(crate) fn device(&self) -> Option<DeviceView> {
        self.gpu
    }

    /// Where the buffer is on its GPU, or `NotSupported` on a host channel.
    pub(crate) fn gpu(&self) -> PyResult<DeviceView> {
        self.gpu
            .ok_or_else(|| errors::not_supported(self.host_text))
    }

    /// `n` host bytes from `offset` (`n`: `None` for the rest): `NotSupported` on a GPU channel,
    /// `InvalidArgument` past the buffer's end.
    pub(crate) fn host_range(
        &self,
        py: Python<'_>,
        offset: usize,
        n: Option<usize>,
    ) -> PyResult<usize> {
        if self.gpu.is_some() {
            return Err(errors::not_supported(GPU_FRAME));
        }
        range_arg(py, offset, n, self.nbytes)
    }
}
