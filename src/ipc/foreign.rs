//! Export of device memory this crate did not allocate: a raw device range from another library
//! (cudarc, a framework's caching allocator, your own `cuMemAlloc`), classified before any IPC call.
//!
//! Owns: [`ForeignBuffer`] (the exporter's view of such a range), the classification of a pointer
//! from the driver's attributes ([`NotExportable`] says why a kind cannot be exported and what to
//! do instead), the process-wide table of this crate's exportable pools (so memory allocated from
//! one with `cuMemAllocAsync` is recognised), and [`MemPool::make_device_current`]
//! (`cuDeviceSetMemPool`). Imports of the tokens go through the ordinary paths
//! ([`super::ImportedBuffer`]); nothing here imports.
//!
//! Classification, in this order (every step a driver query, none an IPC call):
//!
//! | memory | what the driver reports | result |
//! | --- | --- | --- |
//! | null pointer, empty range | — | [`NotExportable::Empty`] |
//! | pageable host memory (a `Vec`) | no memory type, no context | [`NotExportable::UnknownPointer`] |
//! | managed (`cuMemAllocManaged`) | `IS_MANAGED` | [`NotExportable::Managed`] |
//! | page-locked host (`cuMemAllocHost`, `cuMemHostRegister`) | `MEMORY_TYPE` host | [`NotExportable::Host`] |
//! | arrays, other types | `MEMORY_TYPE` array / unified | [`NotExportable::UnsupportedType`] |
//! | memory of another device / context | `DEVICE_ORDINAL`, `CONTEXT` | [`NotExportable::OtherDevice`] / [`NotExportable::OtherContext`] |
//! | a range running past its allocation | `RANGE_START_ADDR`, `RANGE_SIZE` | [`NotExportable::PastAllocation`] |
//! | `cuMemAllocAsync` from the device's default pool | `MEMPOOL_HANDLE` = `cuDeviceGetDefaultMemPool` | [`NotExportable::DefaultPool`] |
//! | `cuMemAllocAsync` from a pool this crate did not make | `MEMPOOL_HANDLE` unknown here | [`NotExportable::OtherPool`] |
//! | from an exportable [`MemPool`], not at the allocation's start | `RANGE_START_ADDR` ≠ pointer | [`NotExportable::PoolSubRange`] |
//! | from an exportable [`MemPool`] | `MEMPOOL_HANDLE` is ours | [`ForeignKind::Pool`]: a pool token |
//! | `cuMemAlloc` | `IS_LEGACY_CUDA_IPC_CAPABLE` | [`ForeignKind::Legacy`]: a legacy token, offset from the base |
//! | VMM (`cuMemCreate` + `cuMemMap`) with POSIX fd handles, one mapping in its reservation | `cuMemRetainAllocationHandle`, `ALLOWED_HANDLE_TYPES` | [`ForeignKind::Vmm`]: a VMM token |
//! | VMM without POSIX fd handles | `ALLOWED_HANDLE_TYPES` | [`NotExportable::VmmNotFdExportable`] |
//! | VMM, several mappings in one reservation | different handles at its ends | [`NotExportable::VmmSharedReservation`] |
//! | anything else | | [`NotExportable::NotLegacyIpcCapable`] |
//!
//! Stream-ordered memory (`cuMemAllocAsync`) can never be exported with legacy IPC: the driver
//! answers `cuIpcGetMemHandle` with `CUDA_ERROR_INVALID_VALUE`. It can be exported when it comes
//! from a pool created with exportable handles, which is what [`MemPool::exportable`] makes;
//! [`MemPool::make_device_current`] makes every `cuMemAllocAsync` of the device (cudarc's
//! allocations among them) use such a pool.
//!
//! A token of a foreign export is imported in another process. The exporting process itself uses
//! the memory directly: a self-import of a foreign export is not served from the local export
//! tables (they hold allocations this crate frees), so the driver refuses it.
//!
//! See <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__UNIFIED.html> (pointer
//! attributes) and <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html>.

use super::cache::lock;
use super::fdpass::FdExport;
use super::pool::{MemPool, PoolInner, our_pool};
use crate::driver::{Context, DeviceMemory};
use crate::error::{Error, Result};
use crate::ffi::{check, sys};
use crate::identity::ProcessIdentity;
use crate::token::{Token, TokenKind};
use std::marker::PhantomData;
use std::mem::MaybeUninit;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

// ---------------------------------------------------------------------------------- statistics

static CLASSIFIED: AtomicU64 = AtomicU64::new(0);
static REFUSED: AtomicU64 = AtomicU64::new(0);
static IPC_EXPORT_CALLS: AtomicU64 = AtomicU64::new(0);

/// Counters of foreign exports since the process started (for tests and monitoring).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ForeignStats {
    /// Pointers classified ([`classify`], [`ForeignBuffer::from_raw`]).
    pub classified: u64,
    /// Of those, refused with [`NotExportable`].
    pub refused: u64,
    /// IPC export calls made for foreign memory (`cuIpcGetMemHandle`, `cuMemPoolExportPointer`,
    /// `cuMemExportToShareableHandle`). A refused pointer never adds to it.
    pub ipc_export_calls: u64,
}

/// A snapshot of the foreign-export counters.
pub fn foreign_stats() -> ForeignStats {
    // Relaxed: independent statistics counters, no data is published through them.
    let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
    ForeignStats {
        classified: get(&CLASSIFIED),
        refused: get(&REFUSED),
        ipc_export_calls: get(&IPC_EXPORT_CALLS),
    }
}

fn bump(c: &AtomicU64) {
    // Relaxed: a statistics counter (see `foreign_stats`).
    c.fetch_add(1, Ordering::Relaxed);
}

// ------------------------------------------------------------------------------ kinds and errors

/// An exportable kind of foreign memory, as [`classify`] found it. Addresses are device addresses
/// in the context the pointer was classified in; sizes in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ForeignKind {
    /// `cuMemAlloc` memory: exported with a legacy `IpcMemHandle` of the whole allocation
    /// `base..base + size` (an importer's mapping covers all of it), the range at its offset.
    Legacy {
        /// Start of the allocation (`CU_POINTER_ATTRIBUTE_RANGE_START_ADDR`).
        base: u64,
        /// Size of the allocation (`CU_POINTER_ATTRIBUTE_RANGE_SIZE`).
        size: usize,
    },
    /// An allocation from one of this crate's exportable pools ([`MemPool::exportable`]):
    /// exported as a pool token (`cuMemPoolExportPointer`), from the allocation's start.
    Pool {
        /// Start of the allocation.
        base: u64,
        /// Size of the allocation.
        size: usize,
    },
    /// A VMM allocation with POSIX file descriptor handles, mapped alone in its reservation
    /// `base..base + size`: exported as a VMM token (`cuMemExportToShareableHandle`).
    Vmm {
        /// Start of the reserved address range.
        base: u64,
        /// Size of the reserved range (the importer maps this much of the allocation).
        size: usize,
    },
}

impl ForeignKind {
    /// Start of the allocation (or reservation) the pointer lies in.
    pub fn base(&self) -> u64 {
        match *self {
            ForeignKind::Legacy { base, .. }
            | ForeignKind::Pool { base, .. }
            | ForeignKind::Vmm { base, .. } => base,
        }
    }
}

/// Why a pointer cannot be exported: the kind of memory, and what to allocate instead. Returned
/// (as [`Error::NotExportable`]) before any IPC call was made.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NotExportable {
    /// A null pointer or a range of zero bytes.
    #[error("a null pointer or an empty range cannot be exported")]
    Empty,
    /// The driver does not know the pointer: pageable host memory (a `Vec`, a `Box`, a stack
    /// array) or no memory at all.
    #[error(
        "{ptr:#x} is not memory the CUDA driver knows (pageable host memory such as a Vec?); host memory cannot be exported: copy it into a DeviceBuffer"
    )]
    UnknownPointer {
        /// The pointer.
        ptr: u64,
    },
    /// Page-locked host memory (`cuMemAllocHost`, `cuMemHostAlloc`, `cuMemHostRegister`).
    #[error(
        "{ptr:#x} is host memory (cuMemAllocHost or cuMemHostRegister); host memory cannot be exported: copy it into a DeviceBuffer"
    )]
    Host {
        /// The pointer.
        ptr: u64,
    },
    /// Managed memory (`cuMemAllocManaged`).
    #[error(
        "{ptr:#x} is managed memory (cuMemAllocManaged); managed memory cannot be exported: allocate a DeviceBuffer, a VmmBuffer or from MemPool::exportable"
    )]
    Managed {
        /// The pointer.
        ptr: u64,
    },
    /// A memory type that has no export (a CUDA array, or a type newer than this crate).
    #[error("{ptr:#x} has CUDA memory type {memory_type}, which cannot be exported")]
    UnsupportedType {
        /// The pointer.
        ptr: u64,
        /// `CU_POINTER_ATTRIBUTE_MEMORY_TYPE`.
        memory_type: u32,
    },
    /// Memory of another device than the context's.
    #[error(
        "{ptr:#x} is memory of device ordinal {found}, not of the context's device {expected}; export it in its own device's context"
    )]
    OtherDevice {
        /// The pointer.
        ptr: u64,
        /// The context's device ordinal.
        expected: i32,
        /// The pointer's device ordinal (`CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL`).
        found: i32,
    },
    /// Memory allocated in another context of the same device (not the primary context).
    #[error(
        "{ptr:#x} was allocated in another context than the device's primary context; export it from the primary context (cudarc's CudaContext::new uses it)"
    )]
    OtherContext {
        /// The pointer.
        ptr: u64,
    },
    /// The range runs past the allocation the pointer lies in.
    #[error(
        "range {ptr:#x}+{len} runs past its allocation {base:#x}+{size}; export at most the allocation"
    )]
    PastAllocation {
        /// The pointer.
        ptr: u64,
        /// The length asked for.
        len: usize,
        /// Start of the allocation.
        base: u64,
        /// Size of the allocation.
        size: usize,
    },
    /// `cuMemAllocAsync` memory from the device's default pool, which has no shareable handles.
    #[error(
        "stream-ordered pool memory from the default pool cannot be exported ({ptr:#x}, cuMemAllocAsync); allocate from MemPool::exportable (MemPool::make_device_current makes cuMemAllocAsync use it) or a DeviceBuffer"
    )]
    DefaultPool {
        /// The pointer.
        ptr: u64,
    },
    /// Stream-ordered memory from a pool this process's cuda-ipc did not create (or has dropped):
    /// its file descriptor is not ours to serve.
    #[error(
        "stream-ordered pool memory from a pool cuda-ipc did not create (or has dropped) cannot be exported ({ptr:#x}); allocate from a live MemPool::exportable or a DeviceBuffer"
    )]
    OtherPool {
        /// The pointer.
        ptr: u64,
    },
    /// Pool memory not at the start of its allocation: a pool token names a whole allocation.
    #[error(
        "pool memory is exported from the start of its allocation: {ptr:#x} lies {offset} bytes into the allocation at {base:#x}; export the whole allocation"
    )]
    PoolSubRange {
        /// The pointer.
        ptr: u64,
        /// Start of the allocation.
        base: u64,
        /// Bytes from the start.
        offset: u64,
    },
    /// VMM memory created without POSIX file descriptor handles.
    #[error(
        "{ptr:#x} is VMM memory created without POSIX file descriptor handles; create it with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR in requestedHandleTypes, or use VmmBuffer"
    )]
    VmmNotFdExportable {
        /// The pointer.
        ptr: u64,
    },
    /// VMM memory whose reservation holds several mappings, so the offset inside the physical
    /// allocation cannot be known.
    #[error(
        "{ptr:#x} is VMM memory whose reserved range {base:#x}+{size} holds more than one mapping, so its offset in the allocation is unknown; map each allocation alone in its own reservation (as VmmBuffer does)"
    )]
    VmmSharedReservation {
        /// The pointer.
        ptr: u64,
        /// Start of the reservation.
        base: u64,
        /// Size of the reservation.
        size: usize,
    },
    /// Device memory the driver does not allow legacy IPC for, and of no other exportable kind.
    #[error(
        "{ptr:#x} is device memory the driver does not allow legacy IPC for (CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE is 0) and of no other exportable kind; allocate a VmmBuffer or from MemPool::exportable"
    )]
    NotLegacyIpcCapable {
        /// The pointer.
        ptr: u64,
    },
}

// --------------------------------------------------------------------- the pure classification

/// Where a stream-ordered allocation comes from (`CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum PoolFact {
    /// No pool: not stream-ordered memory.
    #[default]
    None,
    /// One of this crate's live exportable pools.
    Ours,
    /// The device's default pool.
    DeviceDefault,
    /// Another pool.
    Other,
}

/// What `cuMemRetainAllocationHandle` and `ALLOWED_HANDLE_TYPES` say of VMM memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct VmmFact {
    /// POSIX file descriptor handles allowed.
    pub(crate) fd_handles: bool,
    /// The same allocation handle at both ends of the reservation and at the pointer.
    pub(crate) one_mapping: bool,
}

/// The driver's answers about a pointer, gathered before classifying it. `CU_MEMORYTYPE_*`
/// numbers; `context` the `CUcontext` address (0 when the driver reports none).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct PointerFacts {
    pub(crate) memory_type: u32,
    pub(crate) context: usize,
    pub(crate) device_ordinal: i32,
    pub(crate) is_managed: bool,
    pub(crate) legacy_ipc: bool,
    pub(crate) range_start: u64,
    pub(crate) range_size: usize,
    pub(crate) pool: PoolFact,
    /// `None` when not VMM memory (or not asked: pool or legacy memory is never VMM here).
    pub(crate) vmm: Option<VmmFact>,
}

const MEMORYTYPE_HOST: u32 = 1;
const MEMORYTYPE_DEVICE: u32 = 2;

/// The kind of `ptr..ptr + len` from the driver's facts, for a context `ctx` (its address) on the
/// device with ordinal `ordinal`. Pure: no driver calls.
pub(crate) fn classify_facts(
    f: &PointerFacts,
    ptr: u64,
    len: usize,
    ctx: usize,
    ordinal: i32,
) -> std::result::Result<ForeignKind, NotExportable> {
    use NotExportable as N;
    if ptr == 0 || len == 0 {
        return Err(N::Empty);
    }
    if f.is_managed {
        return Err(N::Managed { ptr });
    }
    match f.memory_type {
        0 if f.context == 0 => return Err(N::UnknownPointer { ptr }),
        MEMORYTYPE_HOST => return Err(N::Host { ptr }),
        MEMORYTYPE_DEVICE => {}
        t => {
            return Err(N::UnsupportedType {
                ptr,
                memory_type: t,
            });
        }
    }
    if f.device_ordinal != ordinal {
        return Err(N::OtherDevice {
            ptr,
            expected: ordinal,
            found: f.device_ordinal,
        });
    }
    // VMM and pool memory belong to no context (the driver reports none); a context reported
    // must be ours.
    if f.context != 0 && f.context != ctx {
        return Err(N::OtherContext { ptr });
    }
    let (base, size) = (f.range_start, f.range_size);
    let inside = ptr >= base
        && (ptr - base)
            .checked_add(len as u64)
            .is_some_and(|end| end <= size as u64);
    if !inside {
        return Err(N::PastAllocation {
            ptr,
            len,
            base,
            size,
        });
    }
    match f.pool {
        PoolFact::None => {}
        PoolFact::DeviceDefault => return Err(N::DefaultPool { ptr }),
        PoolFact::Other => return Err(N::OtherPool { ptr }),
        PoolFact::Ours if ptr != base => {
            return Err(N::PoolSubRange {
                ptr,
                base,
                offset: ptr - base,
            });
        }
        PoolFact::Ours => return Ok(ForeignKind::Pool { base, size }),
    }
    if f.legacy_ipc {
        return Ok(ForeignKind::Legacy { base, size });
    }
    match f.vmm {
        Some(VmmFact {
            fd_handles: false, ..
        }) => Err(N::VmmNotFdExportable { ptr }),
        Some(VmmFact {
            one_mapping: false, ..
        }) => Err(N::VmmSharedReservation { ptr, base, size }),
        Some(_) => Ok(ForeignKind::Vmm { base, size }),
        None => Err(N::NotLegacyIpcCapable { ptr }),
    }
}

// ------------------------------------------------------------------------- the driver's facts

const POSIX_FD: sys::CUmemAllocationHandleType =
    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;

/// `POSIX_FD` as a bit of `CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES`.
fn posix_fd_bit() -> u64 {
    u64::from(crate::driver::MEMPOOL_HANDLE_POSIX_FD)
}

/// Gathers the facts about `ptr` (`cuPointerGetAttributes`, `cuDeviceGetDefaultMemPool`, and for
/// device memory of no pool and no legacy IPC, `cuMemRetainAllocationHandle`). The caller has made
/// `ctx` current.
fn gather(ctx: &Context, ptr: u64) -> Result<PointerFacts> {
    use sys::CUpointer_attribute as A;
    let mut attrs = [
        A::CU_POINTER_ATTRIBUTE_CONTEXT,
        A::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
        A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
        A::CU_POINTER_ATTRIBUTE_IS_MANAGED,
        A::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
        A::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
        A::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
        A::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE,
        A::CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES,
    ];
    // One zeroed 8-byte slot per attribute: wide enough for each one's type (a pointer, a size,
    // an int, a bool, a 64-bit mask), and a value the driver leaves unwritten reads as 0.
    let mut vals = [0u64; 9];
    let mut data: [*mut std::ffi::c_void; 9] = std::array::from_fn(|i| (&raw mut vals[i]).cast());
    // SAFETY: driver loaded (a Context exists); `attrs` and `data` hold 9 entries each, every
    // `data` entry points to 8 writable bytes that outlive the call. The driver does not fail for
    // a pointer it does not know: it writes default values (the call's documented behaviour).
    check("cuPointerGetAttributes", unsafe {
        sys::cuPointerGetAttributes(9, attrs.as_mut_ptr(), data.as_mut_ptr(), ptr)
    })?;
    let [c, t, ord, managed, legacy, start, size, pool, handles] = vals;
    let mut f = PointerFacts {
        context: c as usize,
        memory_type: t as u32,
        device_ordinal: ord as u32 as i32,
        is_managed: managed != 0,
        legacy_ipc: legacy != 0,
        range_start: start,
        range_size: size as usize,
        pool: PoolFact::None,
        vmm: None,
    };
    if pool != 0 {
        f.pool = if our_pool(pool as usize).is_some() {
            PoolFact::Ours
        } else if pool == default_pool(ctx)? as usize as u64 {
            PoolFact::DeviceDefault
        } else {
            PoolFact::Other
        };
    }
    if f.memory_type == MEMORYTYPE_DEVICE
        && f.pool == PoolFact::None
        && !f.legacy_ipc
        && let Some(h) = retain_handle(ptr)
    {
        let end = f.range_start + (f.range_size as u64).saturating_sub(1);
        let one = [f.range_start, end]
            .into_iter()
            .all(|a| retain_handle(a) == Some(h));
        f.vmm = Some(VmmFact {
            fd_handles: handles & posix_fd_bit() != 0,
            one_mapping: one,
        });
    }
    Ok(f)
}

/// The device's default pool (`cuDeviceGetDefaultMemPool`).
fn default_pool(ctx: &Context) -> Result<sys::CUmemoryPool> {
    let mut p = MaybeUninit::<sys::CUmemoryPool>::uninit();
    // SAFETY: driver loaded; valid device; `p` a valid out-pointer.
    check("cuDeviceGetDefaultMemPool", unsafe {
        sys::cuDeviceGetDefaultMemPool(p.as_mut_ptr(), ctx.device().raw())
    })?;
    // SAFETY: written on success.
    Ok(unsafe { p.assume_init() })
}

/// The VMM allocation handle mapped at `addr` (`cuMemRetainAllocationHandle`, released again at
/// once with `cuMemRelease`); `None` when `addr` is not VMM-mapped memory. The handle value is the
/// one used to map the memory (the driver's guarantee), so two addresses compare by it.
fn retain_handle(addr: u64) -> Option<sys::CUmemGenericAllocationHandle> {
    let mut h = MaybeUninit::<sys::CUmemGenericAllocationHandle>::uninit();
    // SAFETY: driver loaded; `h` a valid out-pointer; the driver validates `addr` (an error for
    // memory that is not VMM-mapped). `addr` is passed as the pointer-sized value it is.
    let r = unsafe { sys::cuMemRetainAllocationHandle(h.as_mut_ptr(), addr as usize as *mut _) };
    check("cuMemRetainAllocationHandle", r).ok()?;
    // SAFETY: written on success.
    let h = unsafe { h.assume_init() };
    // SAFETY: the retain above took one reference, released once here.
    if let Err(e) = check("cuMemRelease", unsafe { sys::cuMemRelease(h) }) {
        tracing::warn!("{e}; a VMM allocation stays referenced until exit");
    }
    Some(h)
}

/// Classifies `ptr..ptr + len` (a device address, `len` in bytes) in `ctx`: which exportable kind
/// it is, or why it cannot be exported. Only queries the driver (`cuPointerGetAttributes`,
/// `cuDeviceGetDefaultMemPool`, `cuMemRetainAllocationHandle`); makes no IPC call.
///
/// # Errors
/// [`Error::NotExportable`] naming the kind and the fix (the table in the module doc);
/// [`Error::Cuda`] when a query fails.
///
/// See <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__UNIFIED.html>.
#[doc(alias = "cuPointerGetAttributes")]
pub fn classify(ctx: &Arc<Context>, ptr: u64, len: usize) -> Result<ForeignKind> {
    bump(&CLASSIFIED);
    let r = (|| {
        if ptr == 0 || len == 0 {
            return Err(NotExportable::Empty.into());
        }
        let _cur = ctx.enter()?;
        let f = gather(ctx, ptr)?;
        let ordinal = ctx.device().ordinal() as i32;
        Ok(classify_facts(
            &f,
            ptr,
            len,
            ctx.as_raw() as usize,
            ordinal,
        )?)
    })();
    if let Err(Error::NotExportable(_)) = &r {
        bump(&REFUSED);
    }
    r
}

// --------------------------------------------------------------------------- the export itself

/// What the first export made, kept for the next ones (and, for VMM, the fd offered).
#[derive(Debug)]
enum Exported {
    Legacy([u8; 64]),
    Pool([u8; 64]),
    Vmm(FdExport),
}

/// A range of device memory this crate did not allocate, classified as exportable: made by
/// [`ForeignBuffer::from_raw`] (any raw range) or by the `cudarc` feature's safe constructors
/// (`crate::cudarc_interop`), which borrow the allocation for `'a`. `len` in bytes.
///
/// The memory stays its owner's: dropping this never frees it. What it keeps: for pool memory the
/// [`MemPool`] (so its fd stays offered), for VMM memory the exported fd (offered until this
/// drops). Importers in other processes map it through the ordinary [`super::ImportedBuffer`]
/// paths; the token kinds are those of [`crate::driver::DeviceBuffer`], [`MemPool`] and
/// [`super::VmmBuffer`].
///
/// # Examples
/// ```no_run
/// use cuda_ipc::driver::Context;
/// use cuda_ipc::ipc::ForeignBuffer;
/// let ctx = Context::default_device()?;
/// # let (ptr, len) = (0u64, 0usize);
/// // `ptr`: 1 MiB from another library's cuMemAlloc, kept allocated until importers are done.
/// // SAFETY: the allocation outlives the export and every importer (obligations 1 and 2).
/// let foreign = unsafe { ForeignBuffer::from_raw(&ctx, ptr, len) }?;
/// let token = foreign.export()?;
/// # Ok::<(), cuda_ipc::Error>(())
/// ```
#[derive(Debug)]
pub struct ForeignBuffer<'a> {
    // Drop order: the export (a VMM fd) is withdrawn before the pool and the context are released.
    export: Mutex<Option<Exported>>,
    pool: Option<Arc<PoolInner>>,
    kind: ForeignKind,
    ptr: u64,
    len: usize,
    ctx: Arc<Context>,
    _borrow: PhantomData<&'a ()>,
}

impl ForeignBuffer<'static> {
    /// Classifies `ptr..ptr + len` (a device address and a length in bytes) in `ctx` (see
    /// [`classify`]) and, when it is exportable, wraps it for export. No IPC call is made here;
    /// the first [`ForeignBuffer::export_range`] makes it.
    ///
    /// # Safety
    /// 1. `ptr..ptr + len` stays allocated, and is not freed and reused, until this value dropped
    ///    **and** every importer of every token it made dropped its import: the driver leaves a
    ///    legacy or pool import's contents undefined once the exporter frees the memory (VMM
    ///    imports hold their own reference, so for VMM memory only the first part applies).
    /// 2. For pool memory, the allocation is freed (by its owner) only after the importers
    ///    dropped their imports, as `cuMemPoolImportPointer` requires.
    /// 3. For VMM memory, the allocation is mapped at the start of its reservation from offset 0
    ///    of its physical allocation (as [`super::VmmBuffer`] and most VMM allocators do); a
    ///    reservation holding several mappings is refused, but a single mapping from a non-zero
    ///    offset cannot be told apart.
    /// 4. Writes to the range that importers should see are complete (their stream synchronised,
    ///    or ordered by your own protocol) before importers read.
    ///
    /// # Errors
    /// [`Error::NotExportable`] for memory of a kind that cannot be exported, a range past its
    /// allocation, or memory of another device or context (see the module doc); [`Error::Cuda`]
    /// from the queries.
    #[doc(alias = "cuPointerGetAttributes")]
    pub unsafe fn from_raw(
        ctx: &Arc<Context>,
        ptr: u64,
        len: usize,
    ) -> Result<ForeignBuffer<'static>> {
        // SAFETY: the caller's obligations are ours to pass on; `'static` is what they promise.
        unsafe { Self::borrowed(ctx, ptr, len) }
    }
}

impl<'a> ForeignBuffer<'a> {
    /// As [`ForeignBuffer::from_raw`], for a range the caller keeps allocated for `'a`.
    ///
    /// # Safety
    /// As [`ForeignBuffer::from_raw`], with "until this value dropped" guaranteed by `'a`.
    pub(crate) unsafe fn borrowed(
        ctx: &Arc<Context>,
        ptr: u64,
        len: usize,
    ) -> Result<ForeignBuffer<'a>> {
        let kind = classify(ctx, ptr, len)?;
        let pool = match kind {
            ForeignKind::Pool { .. } => {
                let _cur = ctx.enter()?;
                let raw = pool_of(ptr)?;
                // The pool was ours a moment ago; it may have dropped since.
                Some(our_pool(raw).ok_or(NotExportable::OtherPool { ptr })?)
            }
            _ => None,
        };
        Ok(ForeignBuffer {
            export: Mutex::new(None),
            pool,
            kind,
            ptr,
            len,
            ctx: ctx.clone(),
            _borrow: PhantomData,
        })
    }

    /// The kind of memory, as classified.
    pub fn kind(&self) -> ForeignKind {
        self.kind
    }

    /// A token for the whole range. See [`ForeignBuffer::export_range`].
    ///
    /// # Errors
    /// As [`ForeignBuffer::export_range`].
    pub fn export(&self) -> Result<Token> {
        self.export_range(0, self.len)
    }

    /// A token for bytes `offset..offset + len` of this range (offsets in bytes from
    /// [`DeviceMemory::device_ptr`]). The first call makes the IPC export: `cuIpcGetMemHandle` of
    /// the allocation's base (legacy), `cuMemPoolExportPointer` (pool), or
    /// `cuMemExportToShareableHandle` and an fd offered through [`super::fdpass`] (VMM); later
    /// calls reuse it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the range leaves this one; [`Error::NotExportable`]
    /// ([`NotExportable::PoolSubRange`]) for a pool range not starting at the allocation's start;
    /// [`Error::Unsupported`] when the platform has no legacy IPC ([`crate::probe`]);
    /// [`Error::Cuda`] naming the export call; [`Error::Os`] when the fd server cannot start.
    ///
    /// See <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html>.
    #[doc(alias = "cuIpcGetMemHandle")]
    #[doc(alias = "cuMemPoolExportPointer")]
    pub fn export_range(&self, offset: usize, len: usize) -> Result<Token> {
        crate::driver::memory_check_range(offset, len, self.len)?;
        let at = self.ptr + offset as u64;
        let from_base = at - self.kind.base();
        if let ForeignKind::Pool { base, .. } = self.kind
            && from_base != 0
        {
            return Err(NotExportable::PoolSubRange {
                ptr: at,
                base,
                offset: from_base,
            }
            .into());
        }
        let mut ex = lock(&self.export);
        if ex.is_none() {
            *ex = Some(self.make_export()?);
        }
        let (kind, handle, export_id) = match ex.as_ref().expect("set above") {
            Exported::Legacy(h) => (TokenKind::LegacyMemory, *h, 0),
            Exported::Pool(d) => (
                TokenKind::PoolMemory,
                *d,
                self.pool.as_ref().expect("pool kind").export.id(),
            ),
            Exported::Vmm(e) => {
                let mut h = [0u8; 64];
                h[..4].copy_from_slice(&e.raw_fd().to_le_bytes());
                let size = match self.kind {
                    ForeignKind::Vmm { size, .. } => size as u64,
                    _ => unreachable!("VMM export of VMM memory"),
                };
                h[8..16].copy_from_slice(&size.to_le_bytes());
                (TokenKind::VmmMemory, h, e.id())
            }
        };
        Ok(Token {
            kind,
            handle,
            offset: from_base,
            len: len as u64,
            device: self.ctx.device().uuid(),
            exporter: ProcessIdentity::current()?,
            export_id,
        })
    }

    /// The one IPC export of this range's allocation.
    fn make_export(&self) -> Result<Exported> {
        let _cur = self.ctx.enter()?;
        match self.kind {
            ForeignKind::Legacy { base, .. } => {
                crate::probe::require_legacy_ipc(&self.ctx.device())?;
                let mut h = MaybeUninit::<sys::CUipcMemHandle>::uninit();
                bump(&IPC_EXPORT_CALLS);
                // SAFETY: context current (guard above); `base` is the start of a live cuMemAlloc
                // allocation of this context (classified, kept allocated by the constructor's
                // contract); `h` a valid out-pointer.
                check("cuIpcGetMemHandle", unsafe {
                    sys::cuIpcGetMemHandle(h.as_mut_ptr(), base)
                })?;
                // SAFETY: written on success.
                let h = unsafe { h.assume_init() };
                Ok(Exported::Legacy(h.reserved.map(|b| b as u8)))
            }
            ForeignKind::Pool { base, .. } => {
                let mut out = MaybeUninit::<sys::CUmemPoolPtrExportData>::uninit();
                bump(&IPC_EXPORT_CALLS);
                // SAFETY: context current; `base` is the start of a live allocation of one of our
                // exportable pools (classified; the pool is held by `self.pool`); `out` a valid
                // out-pointer.
                check("cuMemPoolExportPointer", unsafe {
                    sys::cuMemPoolExportPointer(out.as_mut_ptr(), base)
                })?;
                // SAFETY: written on success.
                Ok(Exported::Pool(unsafe { out.assume_init() }.reserved))
            }
            ForeignKind::Vmm { .. } => {
                let mut h = MaybeUninit::<sys::CUmemGenericAllocationHandle>::uninit();
                // SAFETY: context current; `h` a valid out-pointer; `ptr` is VMM-mapped memory
                // (classified), passed as the pointer-sized value it is.
                check("cuMemRetainAllocationHandle", unsafe {
                    sys::cuMemRetainAllocationHandle(h.as_mut_ptr(), self.ptr as usize as *mut _)
                })?;
                // SAFETY: written on success.
                let h = unsafe { h.assume_init() };
                let mut fd: i32 = -1;
                bump(&IPC_EXPORT_CALLS);
                // SAFETY: `h` is a live handle (retained above) that allows POSIX fd handles
                // (classified); for this handle type the out-parameter is one `int`.
                let r = check("cuMemExportToShareableHandle", unsafe {
                    sys::cuMemExportToShareableHandle((&raw mut fd).cast(), h, POSIX_FD, 0)
                });
                // SAFETY: the retain above took one reference, released once here; the exported
                // fd holds its own.
                if let Err(e) = check("cuMemRelease", unsafe { sys::cuMemRelease(h) }) {
                    tracing::warn!("{e}; a VMM allocation stays referenced until exit");
                }
                r?;
                if fd < 0 {
                    return Err(Error::InvalidArgument(format!(
                        "the driver exported file descriptor {fd}"
                    )));
                }
                // SAFETY: a new descriptor from the driver that nothing else owns.
                let fd = unsafe { OwnedFd::from_raw_fd(fd) };
                Ok(Exported::Vmm(FdExport::new(fd)?))
            }
        }
    }
}

/// The pool `ptr` was allocated from (`CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE`), as an address; the
/// caller made a context current.
fn pool_of(ptr: u64) -> Result<usize> {
    let mut p: usize = 0;
    // SAFETY: driver loaded; `p` is pointer-sized and writable for the call; the driver validates
    // `ptr`.
    check("cuPointerGetAttribute", unsafe {
        sys::cuPointerGetAttribute(
            (&raw mut p).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE,
            ptr,
        )
    })?;
    Ok(p)
}

impl DeviceMemory for ForeignBuffer<'_> {
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn context(&self) -> &Arc<Context> {
        &self.ctx
    }
}

// ------------------------------------------------------------------- the device's current pool

/// [`MemPool`] as the device's current pool, made by [`MemPool::make_device_current`]: while it
/// lives, every `cuMemAllocAsync` on the device, in every library of this process, allocates from
/// the pool. Dropping it (or [`DevicePoolGuard::restore`]) makes the pool the device had before
/// current again, unless someone else changed the device's pool meanwhile (then theirs stays).
/// Allocations made meanwhile stay in the pool and exportable after the restore.
#[derive(Debug)]
#[must_use = "the pool is the device's current pool only while the guard lives"]
pub struct DevicePoolGuard {
    previous: sys::CUmemoryPool,
    pool: MemPool,
    restored: bool,
}

// SAFETY: the raw pool is a process-wide driver handle only passed back to the driver
// (`cuDeviceSetMemPool`), which synchronises its own state; `MemPool` is Send and Sync.
unsafe impl Send for DevicePoolGuard {}
// SAFETY: as for Send; `&DevicePoolGuard` exposes no driver call.
unsafe impl Sync for DevicePoolGuard {}

impl MemPool {
    /// Makes this pool the current memory pool of its device (`cuDeviceGetMemPool`, then
    /// `cuDeviceSetMemPool`), until the returned guard drops.
    ///
    /// **This is process-wide**: it changes the pool that every `cuMemAllocAsync` on this device
    /// uses, in every thread and every library of the process (cudarc's `CudaStream::alloc`,
    /// frameworks on top of it, your own calls), not only in the caller. Use it when another
    /// library allocates the memory you want to export and cannot be told which pool to use
    /// (cudarc 0.19 has no allocate-from-pool call); keep the pool alive as long as you export
    /// from it. When you can allocate yourself, prefer a [`crate::driver::DeviceBuffer`],
    /// [`MemPool::alloc`] or a channel's buffers, and give the other library a view of them.
    ///
    /// # Errors
    /// [`Error::Cuda`] naming `cuDeviceGetMemPool` or `cuDeviceSetMemPool`.
    ///
    /// See <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html>.
    #[doc(alias = "cuDeviceSetMemPool")]
    pub fn make_device_current(&self) -> Result<DevicePoolGuard> {
        let ctx = &self.inner.ctx;
        let _cur = ctx.enter()?;
        let previous = current_pool(ctx)?;
        // SAFETY: valid device of a loaded driver; the pool is live (held by `self`, and by the
        // guard from here on) and was created for this device.
        check("cuDeviceSetMemPool", unsafe {
            sys::cuDeviceSetMemPool(ctx.device().raw(), self.inner.pool)
        })?;
        Ok(DevicePoolGuard {
            previous,
            pool: self.clone(),
            restored: false,
        })
    }
}

/// The device's current pool (`cuDeviceGetMemPool`).
fn current_pool(ctx: &Context) -> Result<sys::CUmemoryPool> {
    let mut p = MaybeUninit::<sys::CUmemoryPool>::uninit();
    // SAFETY: driver loaded; valid device; `p` a valid out-pointer.
    check("cuDeviceGetMemPool", unsafe {
        sys::cuDeviceGetMemPool(p.as_mut_ptr(), ctx.device().raw())
    })?;
    // SAFETY: written on success.
    Ok(unsafe { p.assume_init() })
}

impl DevicePoolGuard {
    /// The pool made current.
    pub fn pool(&self) -> &MemPool {
        &self.pool
    }

    /// Makes the device's previous pool current again now (`cuDeviceSetMemPool`), when this pool
    /// is still the current one; reports what drop would only log.
    ///
    /// # Errors
    /// [`Error::Cuda`] naming `cuDeviceGetMemPool` or `cuDeviceSetMemPool`.
    pub fn restore(mut self) -> Result<()> {
        self.restored = true;
        self.restore_now()
    }

    fn restore_now(&self) -> Result<()> {
        let ctx = &self.pool.inner.ctx;
        let _cur = ctx.enter()?;
        if current_pool(ctx)? != self.pool.inner.pool {
            tracing::info!("the device's memory pool was changed by someone else; left as it is");
            return Ok(());
        }
        // SAFETY: valid device; `previous` was the device's current pool when the guard was made
        // (the default pool, or a pool its owner keeps alive while it is current, as the driver
        // requires of every current pool).
        check("cuDeviceSetMemPool", unsafe {
            sys::cuDeviceSetMemPool(ctx.device().raw(), self.previous)
        })?;
        Ok(())
    }
}

impl Drop for DevicePoolGuard {
    fn drop(&mut self) {
        if self.restored {
            return;
        }
        if let Err(e) = self.restore_now() {
            // Safe to go on: the pool stays current and alive while allocations use it (the
            // driver makes the default pool current again when a current pool is destroyed).
            tracing::warn!("{e}; the exportable pool stays the device's current pool");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CTX: usize = 0x1000;
    const PTR: u64 = 0x7f00_0000_0000;

    fn device(base: u64, size: usize) -> PointerFacts {
        PointerFacts {
            memory_type: MEMORYTYPE_DEVICE,
            context: CTX,
            device_ordinal: 0,
            legacy_ipc: true,
            range_start: base,
            range_size: size,
            ..Default::default()
        }
    }

    fn classify(
        f: &PointerFacts,
        ptr: u64,
        len: usize,
    ) -> std::result::Result<ForeignKind, NotExportable> {
        classify_facts(f, ptr, len, CTX, 0)
    }

    #[test]
    fn legacy_memory_is_exported_from_its_allocation_base() {
        let f = device(PTR, 4096);
        assert_eq!(
            classify(&f, PTR + 256, 1024),
            Ok(ForeignKind::Legacy {
                base: PTR,
                size: 4096
            })
        );
        assert_eq!(classify(&f, PTR, 4096).map(|k| k.base()), Ok(PTR));
    }

    #[test]
    fn a_range_past_the_allocation_end_is_refused() {
        let f = device(PTR, 4096);
        assert!(matches!(
            classify(&f, PTR + 4000, 97),
            Err(NotExportable::PastAllocation { size: 4096, .. })
        ));
        assert!(matches!(
            classify(&f, PTR - 1, 2),
            Err(NotExportable::PastAllocation { .. })
        ));
        assert!(matches!(
            classify(&f, u64::MAX - 1, usize::MAX),
            Err(NotExportable::PastAllocation { .. })
        ));
    }

    #[test]
    fn null_pointers_and_empty_ranges_are_refused() {
        let f = device(PTR, 4096);
        assert_eq!(classify(&f, 0, 8), Err(NotExportable::Empty));
        assert_eq!(classify(&f, PTR, 0), Err(NotExportable::Empty));
    }

    #[test]
    fn pageable_host_memory_is_an_unknown_pointer() {
        let f = PointerFacts::default();
        assert_eq!(
            classify(&f, PTR, 8),
            Err(NotExportable::UnknownPointer { ptr: PTR })
        );
    }

    #[test]
    fn page_locked_host_memory_is_refused_as_host() {
        let f = PointerFacts {
            memory_type: MEMORYTYPE_HOST,
            context: CTX,
            ..Default::default()
        };
        assert_eq!(classify(&f, PTR, 8), Err(NotExportable::Host { ptr: PTR }));
    }

    #[test]
    fn managed_memory_is_refused_whatever_type_the_driver_reports() {
        for t in [MEMORYTYPE_DEVICE, MEMORYTYPE_HOST, 4] {
            let f = PointerFacts {
                memory_type: t,
                is_managed: true,
                ..device(PTR, 4096)
            };
            assert_eq!(
                classify(&f, PTR, 8),
                Err(NotExportable::Managed { ptr: PTR })
            );
        }
    }

    #[test]
    fn arrays_and_unknown_types_are_refused_with_the_type() {
        let f = PointerFacts {
            memory_type: 3,
            ..device(PTR, 4096)
        };
        assert_eq!(
            classify(&f, PTR, 8),
            Err(NotExportable::UnsupportedType {
                ptr: PTR,
                memory_type: 3
            })
        );
    }

    #[test]
    fn memory_of_another_device_or_context_is_refused() {
        let f = PointerFacts {
            device_ordinal: 1,
            ..device(PTR, 4096)
        };
        assert!(matches!(
            classify(&f, PTR, 8),
            Err(NotExportable::OtherDevice {
                expected: 0,
                found: 1,
                ..
            })
        ));
        let f = PointerFacts {
            context: CTX + 8,
            ..device(PTR, 4096)
        };
        assert_eq!(
            classify(&f, PTR, 8),
            Err(NotExportable::OtherContext { ptr: PTR })
        );
    }

    #[test]
    fn default_pool_memory_is_refused_with_the_exportable_pool_as_fix() {
        let f = PointerFacts {
            legacy_ipc: false,
            context: 0,
            pool: PoolFact::DeviceDefault,
            ..device(PTR, 4096)
        };
        let e = classify(&f, PTR, 8).unwrap_err();
        assert_eq!(e, NotExportable::DefaultPool { ptr: PTR });
        let s = e.to_string();
        assert!(
            s.contains("default pool") && s.contains("MemPool::exportable"),
            "{s}"
        );
    }

    #[test]
    fn memory_of_another_pool_is_refused() {
        let f = PointerFacts {
            legacy_ipc: false,
            pool: PoolFact::Other,
            ..device(PTR, 4096)
        };
        assert_eq!(
            classify(&f, PTR, 8),
            Err(NotExportable::OtherPool { ptr: PTR })
        );
    }

    #[test]
    fn memory_of_our_pool_is_exported_from_the_allocation_start_only() {
        let f = PointerFacts {
            legacy_ipc: false,
            context: 0,
            pool: PoolFact::Ours,
            ..device(PTR, 4096)
        };
        assert_eq!(
            classify(&f, PTR, 100),
            Ok(ForeignKind::Pool {
                base: PTR,
                size: 4096
            })
        );
        assert_eq!(
            classify(&f, PTR + 64, 100),
            Err(NotExportable::PoolSubRange {
                ptr: PTR + 64,
                base: PTR,
                offset: 64
            })
        );
    }

    #[test]
    fn pool_memory_is_never_taken_for_legacy_memory() {
        // Even if a driver reported pool memory as legacy capable, the pool decides.
        let f = PointerFacts {
            pool: PoolFact::DeviceDefault,
            ..device(PTR, 4096)
        };
        assert_eq!(
            classify(&f, PTR, 8),
            Err(NotExportable::DefaultPool { ptr: PTR })
        );
    }

    #[test]
    fn vmm_memory_needs_fd_handles_and_one_mapping() {
        let vmm = |fd_handles, one_mapping| PointerFacts {
            legacy_ipc: false,
            context: 0,
            vmm: Some(VmmFact {
                fd_handles,
                one_mapping,
            }),
            ..device(PTR, 2 << 20)
        };
        assert_eq!(
            classify(&vmm(true, true), PTR + 4096, 8),
            Ok(ForeignKind::Vmm {
                base: PTR,
                size: 2 << 20
            })
        );
        assert_eq!(
            classify(&vmm(false, true), PTR, 8),
            Err(NotExportable::VmmNotFdExportable { ptr: PTR })
        );
        assert!(matches!(
            classify(&vmm(true, false), PTR, 8),
            Err(NotExportable::VmmSharedReservation { .. })
        ));
    }

    #[test]
    fn device_memory_of_no_exportable_kind_is_refused() {
        let f = PointerFacts {
            legacy_ipc: false,
            ..device(PTR, 4096)
        };
        assert_eq!(
            classify(&f, PTR, 8),
            Err(NotExportable::NotLegacyIpcCapable { ptr: PTR })
        );
    }

    #[test]
    fn every_refusal_reads_lower_case_without_a_final_period() {
        let all = [
            NotExportable::Empty,
            NotExportable::UnknownPointer { ptr: PTR },
            NotExportable::Host { ptr: PTR },
            NotExportable::Managed { ptr: PTR },
            NotExportable::DefaultPool { ptr: PTR },
            NotExportable::OtherPool { ptr: PTR },
            NotExportable::VmmNotFdExportable { ptr: PTR },
            NotExportable::NotLegacyIpcCapable { ptr: PTR },
        ];
        for e in all {
            let s = e.to_string();
            assert!(!s.ends_with('.'), "{s}");
            assert!(s.chars().next().is_some_and(|c| !c.is_uppercase()), "{s}");
        }
    }
}
