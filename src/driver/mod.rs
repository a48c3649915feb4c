//! Safe CUDA driver objects: [`Device`], [`Context`], [`DeviceBuffer`], [`Stream`], [`Event`],
//! [`Module`] / [`Function`], [`Graph`] (a stream's work captured once, replayed).
//!
//! Owns: the lifetime of every driver object this crate creates, and the rule that each holds the
//! [`Context`] it was made in (an `Arc<Context>`), so the context outlives everything made from it.
//! Every method, and every drop, makes its context current only for its own driver calls
//! ([`Context::enter`]: `cuCtxGetCurrent`, and `cuCtxPushCurrent_v2` / `cuCtxPopCurrent_v2` only
//! when another context or none is current), so objects can be used and dropped from any thread,
//! and the thread's own current context (another library's, or none) is current again afterwards,
//! on success and on error. Only [`Context::bind`] leaves a context current. Must not touch shared
//! memory, the registry or IPC handles (that is `ipc`'s job).
//!
//! NVIDIA documentation: <https://docs.nvidia.com/cuda/cuda-driver-api/>.

mod context;
mod device;
mod event;
mod graph;
mod memory;
mod module;
mod stream;

pub use context::{Context, CurrentGuard, warm_up};
pub use device::{
    ComputeMode, Device, DeviceCapabilities, MEMPOOL_HANDLE_FABRIC, MEMPOOL_HANDLE_POSIX_FD, Uuid,
    driver_version,
};
pub use event::Event;
pub use graph::Graph;
pub(crate) use memory::check_range as memory_check_range;
pub(crate) use memory::{Allocation, HostRegistration};
pub use memory::{DeviceBuffer, DeviceMemory};
pub use module::{Function, LaunchConfig, Module};
pub use stream::Stream;
