//! Sharing memory and events with other processes: `IpcMemHandle`, `IpcEventHandle`, tokens, and the
//! process-wide import caches.
//!
//! Owns: export (`cuIpcGetMemHandle`, `cuIpcGetEventHandle`), import (`cuIpcOpenMemHandle_v2`,
//! `cuIpcOpenEventHandle`, VMM and pool imports) and close (`cuIpcCloseMemHandle`, ...), the import
//! caches (one mapping per handle, exporter and context, reference counted; one event per handle
//! and context), and the local export tables that let a process import its own handles (the driver
//! refuses that with `CUDA_ERROR_INVALID_CONTEXT`). Must not touch shared memory or the registry.
//!
//! Every cache is a single-flight table (`flight.rs`): threads importing the same key at once get
//! one driver open and share its result (or its error); imports of other keys never wait for it;
//! the last drop closes once, and a re-import of the key waits for that close.
//!
//! Legacy IPC handles name a whole `cuMemAlloc` allocation: a token carries (handle, offset from the
//! base, length) and the importer sees only that range through [`ImportedBuffer`], but the mapping
//! covers the whole allocation. See
//! <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html> (`cuIpc*`).
//!
//! A batched import (`ImportedBuffer::open_many`, crate-internal) fetches the fds of every VMM
//! allocation of a list that is not in the cache at once, from a source it is given (by default
//! the exporters, one round trip each), then imports each through the cache as one alone is.
//!
//! [`fdpass`] moves file descriptors (VMM and memory-pool exports) between processes of one user
//! over a Unix socket file in `/dev/shm` (reachable across network and pid namespaces), with
//! `pidfd_getfd` as an optional fast path; it does not call CUDA.
//!
//! [`VmmArena`] carves many device allocations out of a few large VMM chunks (PyTorch's pluggable
//! allocator in the Python extension), so memory allocated piecemeal is shared with few imports.
//!
//! [`ForeignBuffer`] exports memory other libraries allocated, after classifying it ([`classify`]:
//! `cuPointerGetAttributes`, before any IPC call); [`MemPool::make_device_current`] makes an
//! exportable pool the one `cuMemAllocAsync` uses.

mod arena;
mod cache;
mod event;
pub mod fdpass;
mod flight;
mod foreign;
mod handle;
mod memory;
mod pool;
mod shareable;
mod vmm;

pub use arena::{ARENA_ALIGN, ArenaOptions, ArenaStats, DEFAULT_CHUNK_BYTES, VmmArena};
pub use cache::{Access, CacheStats, cache_stats};
pub(crate) use cache::{IMPORT_STEPS, ImportStep, import_times_on_this_thread};
pub use event::IpcEvent;
pub use fdpass::{FdPassError, FdTransport};
pub use foreign::{
    DevicePoolGuard, ForeignBuffer, ForeignKind, ForeignStats, NotExportable, classify,
    foreign_stats,
};
pub use handle::{IpcEventHandle, IpcMemHandle, NotImportable};
pub use memory::{Imported, ImportedBuffer};
pub use pool::{MemPool, PoolBuffer};
pub use shareable::{fd_transport, set_fd_transport};
pub(crate) use shareable::{fetch_from_exporters, fetch_from_exporters_then};
pub(crate) use vmm::{StableRange, min_granularity};
pub use vmm::{VmmBuffer, fabric_handles, vmm_granularity};
