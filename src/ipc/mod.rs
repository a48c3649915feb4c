//! Sharing memory and events with other processes: `IpcMemHandle`, `IpcEventHandle`, tokens, and the
//! process-wide import cache.
//!
//! Owns: export (`cuIpcGetMemHandle`, `cuIpcGetEventHandle`), import (`cuIpcOpenMemHandle_v2`,
//! `cuIpcOpenEventHandle`) and close (`cuIpcCloseMemHandle`), the import cache (one mapping per
//! handle, exporter and context, reference counted), and the local export table that lets a process
//! import its own handles (the driver refuses that with `CUDA_ERROR_INVALID_CONTEXT`). Must not touch
//! shared memory or the registry.
//!
//! Legacy IPC handles name a whole `cuMemAlloc` allocation: a token carries (handle, offset from the
//! base, length) and the importer sees only that range through [`ImportedBuffer`], but the mapping
//! covers the whole allocation. See
//! <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html> (`cuIpc*`).
//!
//! [`fdpass`] moves file descriptors (VMM and memory-pool exports) between processes of one user
//! over a Unix socket, with `pidfd_getfd` as an optional fast path; it does not call CUDA.

mod cache;
mod event;
pub mod fdpass;
mod flight;
mod handle;
mod memory;
mod vmm;

pub use cache::{CacheStats, cache_stats};
pub use event::IpcEvent;
pub use fdpass::FdTransport;
pub use handle::{IpcEventHandle, IpcMemHandle};
pub use memory::ImportedBuffer;
pub use vmm::{
    MemPool, PoolBuffer, VmmBuffer, fabric_handles, fd_transport, set_fd_transport, vmm_granularity,
};
