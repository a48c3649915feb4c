//! Export of device memory this crate did not allocate: a raw device range from another library
//! (cudarc, a framework's caching allocator, your own `cuMemAlloc`), classified before any IPC call.
//!
//! Owns: [`ForeignBuffer`] (the exporter's view of such a range), the classification of a pointer
//! from the driver's attributes ([`NotExportable`] says why a kind cannot be exported and what to
//! do instead), the process-wide table of this crate's exportable pools (so memory allocated from
//! one with `cuMemAllocAsync` is recognised), and [`MemPool::make_device_current`](super::MemPool::make_device_current)
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
//! | from an exportable [`MemPool`](super::MemPool), not at the allocation's start | `RANGE_START_ADDR` ≠ pointer | [`NotExportable::PoolSubRange`] |
//! | from an exportable [`MemPool`](super::MemPool) | `MEMPOOL_HANDLE` is ours | [`ForeignKind::Pool`]: a pool token |
//! | `cuMemAlloc` | `IS_LEGACY_CUDA_IPC_CAPABLE` | [`ForeignKind::Legacy`]: a legacy token, offset from the base |
//! | VMM (`cuMemCreate` + `cuMemMap`) with POSIX fd handles, one mapping in its reservation | `cuMemRetainAllocationHandle`, `ALLOWED_HANDLE_TYPES` | [`ForeignKind::Vmm`]: a VMM token |
//! | VMM without POSIX fd handles | `ALLOWED_HANDLE_TYPES` | [`NotExportable::VmmNotFdExportable`] |
//! | VMM, several mappings in one reservation | different handles at its ends | [`NotExportable::VmmSharedReservation`] |
//! | anything else | | [`NotExportable::NotLegacyIpcCapable`] |
//!
//! Stream-ordered memory (`cuMemAllocAsync`) can never be exported with legacy IPC: the driver
//! answers `cuIpcGetMemHandle` with `CUDA_ERROR_INVALID_VALUE`. It can be exported when it comes
//! from a pool created with exportable handles, which is what [`MemPool::exportable`](super::MemPool::exportable) makes;
//! [`MemPool::make_device_current`](super::MemPool::make_device_current) makes every `cuMemAllocAsync` of the device (cudarc's
//! allocations among them) use such a pool.
//!
//! A token of a foreign export is imported in another process. The exporting process itself uses
//! the memory directly: a self-import of a foreign export is not served from the local export
//! tables (they hold allocations this crate frees), so the driver refuses it.
//!
//! See <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__UNIFIED.html> (pointer
//! attributes) and <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html>.
//!
//! Files: `kind` (the exportable kinds, [`NotExportable`], the classification from the driver's
//! facts and the queries that gather them, [`classify`]), `device_pool` ([`DevicePoolGuard`],
//! [`MemPool::make_device_current`](super::MemPool::make_device_current)); the export itself and the counters here. Neither file names
//! the other.

mod device_pool;
mod kind;

pub use device_pool::DevicePoolGuard;
pub use kind::{ForeignKind, NotExportable, classify};

use super::cache::lock;
use super::fdpass::FdExport;
use super::pool::{PoolInner, our_pool};
use crate::driver::{Context, DeviceMemory};
use crate::error::{Error, Result};
use crate::ffi::{check, sys};
use crate::identity::ProcessIdentity;
use crate::token::{Token, TokenKind};
use kind::POSIX_FD;
use std::marker::PhantomData;
use std::mem::MaybeUninit;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

// ---------------------------------------------------------------------------------- statistics

pub(super) static CLASSIFIED: AtomicU64 = AtomicU64::new(0);
pub(super) static REFUSED: AtomicU64 = AtomicU64::new(0);
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

pub(super) fn bump(c: &AtomicU64) {
    // Relaxed: a statistics counter (see `foreign_stats`).
    c.fetch_add(1, Ordering::Relaxed);
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
/// [`MemPool`](super::MemPool) (so its fd stays offered), for VMM memory the exported fd (offered until this
/// drops). Importers in other processes map it through the ordinary [`super::ImportedBuffer`]
/// paths; the token kinds are those of [`crate::driver::DeviceBuffer`], [`MemPool`](super::MemPool) and
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
