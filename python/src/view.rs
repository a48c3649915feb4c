//! Where a frame's buffer is, as both frame classes read it from the library's one view
//! (`cuda_ipc::channel::FrameBuffer`).

use crate::args::range_arg;
use crate::errors;
use crate::util::GPU_FRAME;
use cuda_ipc::channel::FrameBuffer;
use cuda_ipc::driver::DeviceMemory;
use cuda_ipc::identity::ForkEpoch;
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
/// `NotSupported` here, in one place; so does every accessor in a process forked from the one
/// that made the frame ([`Buffer::check_fork`]), before it tells a host frame from a GPU one: the
/// address, stream and bytes are the parent's (as the library's frames refuse theirs there).
pub(crate) struct Buffer {
    /// The buffer's length in bytes.
    pub(crate) nbytes: usize,
    gpu: Option<DeviceView>,
    /// What a GPU accessor of a host frame raises (it names the class's host accessors).
    host_text: &'static str,
    /// The process (by fork) that received or acquired the frame.
    fork: ForkEpoch,
    /// What the frame is, for the error of a forked child's call (`"channel frame"`).
    what: &'static str,
}

impl Buffer {
    /// The buffer of a frame whose view is `view`, made in this process; `host_text` is the
    /// message of a GPU accessor asked of a host frame, `what` names the frame in a forked
    /// child's error.
    pub(crate) fn of<B: DeviceMemory>(
        view: FrameBuffer<'_, B>,
        host_text: &'static str,
        what: &'static str,
    ) -> Buffer {
        let (nbytes, gpu) = DeviceView::of(view);
        Buffer {
            nbytes,
            gpu,
            host_text,
            fork: ForkEpoch::now(),
            what,
        }
    }

    /// Whether this is a forked child's copy of a frame its parent had ([`ForkEpoch::inherited`]).
    pub(crate) fn is_forked_copy(&self) -> bool {
        self.fork.inherited()
    }

    /// `NotSupported` in a process forked from the one that made the frame: the first step of
    /// every call that reads, writes, orders, publishes or hands out the frame's buffer, taken
    /// before any lock (a thread of the parent may have held the frame's at the fork).
    pub(crate) fn check_fork(&self) -> PyResult<()> {
        errors::check_fork(self.fork, self.what)
    }

    /// Whether the buffer is host memory.
    pub(crate) fn is_host(&self) -> bool {
        self.gpu.is_none()
    }

    /// Where the buffer is on its GPU; `None` for host memory.
    pub(crate) fn device(&self) -> Option<DeviceView> {
        self.gpu
    }

    /// Where the buffer is on its GPU, or `NotSupported` on a host channel and in a forked child.
    pub(crate) fn gpu(&self) -> PyResult<DeviceView> {
        self.check_fork()?;
        self.gpu
            .ok_or_else(|| errors::not_supported(self.host_text))
    }

    /// `n` host bytes from `offset` (`n`: `None` for the rest): `NotSupported` on a GPU channel
    /// and in a forked child, `InvalidArgument` past the buffer's end.
    pub(crate) fn host_range(
        &self,
        py: Python<'_>,
        offset: usize,
        n: Option<usize>,
    ) -> PyResult<usize> {
        self.check_fork()?;
        if self.gpu.is_some() {
            return Err(errors::not_supported(GPU_FRAME));
        }
        range_arg(py, offset, n, self.nbytes)
    }
}
