//! VMM allocations (`cuMemCreate`) shared as POSIX file descriptors, the route NCCL and PyTorch's
//! expandable segments take.
//!
//! Owns: [`VmmBuffer`] on the exporting side, the table of this process's VMM exports (for
//! self-imports), the importer's mapping of a VMM token (reserve, import, map, set access; teardown
//! in the reverse order: [`VmmMap`]), the stable ranges mapped allocations are mapped at in turn
//! ([`StableRange`]), [`vmm_granularity`] and the [`fabric_handles`] probe. What it
//! shares with pool memory (the fd handle type, the peer check, the fd fetch and its transport) is
//! in `shareable.rs`; memory pools are `pool.rs`, which it does not import, nor that this file.
//! File descriptors travel through [`super::fdpass`]; the import cache is [`super::cache`].
//!
//! Unlike a legacy `IpcMemHandle`, an imported VMM allocation holds its own reference to the physical
//! memory: it stays valid when the exporter frees it or dies, until the importer drops it.
//!
//! Who closes a file descriptor: the exporter's copy belongs to the buffer's
//! [`super::fdpass::FdExport`] (closed when the buffer and its clones drop); an importer's copy is
//! closed by [`open_vmm`] right after `cuMemImportFromShareableHandle`, on success and on failure
//! (the driver does not take ownership of it). An fd passed to
//! [`super::ImportedBuffer::from_vmm_fd`] stays the caller's.
//!
//! Mappings go into the cache as opaque keep-alives, so the cache names none of these types.
//!
//! See <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html>.

use super::cache::Access;
use super::cache::{self, ImportStep, Mapping, MappingKey, Origin, lock};
use super::fdpass::{FdExport, own_offered};
use super::shareable::{POSIX_FD, access_desc_for, fetch_fd, location, require_peer};
use crate::driver::{Context, Device, DeviceMemory};
use crate::error::{Error, Result};
use crate::ffi::{check, sys};
use crate::identity::ProcessIdentity;
use crate::token::{Token, TokenKind};
use std::collections::BTreeMap;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

/// VMM exports of this process: fd export id → allocation (for self-imports).
static LOCAL_VMM: Mutex<BTreeMap<u32, Weak<VmmAllocation>>> = Mutex::new(BTreeMap::new());

/// The properties of a pinned allocation on `dev` with the shareable handle types `types`, for
/// `cuMemCreate` and `cuMemGetAllocationGranularity`.
fn alloc_prop(dev: &Device, types: sys::CUmemAllocationHandleType) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: types,
        location: location(dev),
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// The minimum granularity of VMM mappings on `dev` (`cuMemGetAllocationGranularity`,
/// `CU_MEM_ALLOC_GRANULARITY_MINIMUM`, no shareable handle type): the unit in which a mapping's
/// presence and access can change.
///
/// # Errors
/// [`Error::Cuda`] from the query.
pub(crate) fn min_granularity(dev: &Device) -> Result<usize> {
    granularity(
        &alloc_prop(dev, sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE),
        sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
    )
}

/// `cuMemGetAllocationGranularity` of `prop` for `flag`, in bytes (at least 1).
fn granularity(
    prop: &sys::CUmemAllocationProp,
    flag: sys::CUmemAllocationGranularity_flags,
) -> Result<usize> {
    let mut g = MaybeUninit::<usize>::uninit();
    // SAFETY: driver loaded (a Device exists); `prop` is a fully initialised property struct;
    // `g` a valid out-pointer.
    check("cuMemGetAllocationGranularity", unsafe {
        sys::cuMemGetAllocationGranularity(g.as_mut_ptr(), prop, flag)
    })?;
    // SAFETY: written on success.
    Ok(unsafe { g.assume_init() }.max(1))
}

/// Checks that `dev` can make VMM allocations exportable as POSIX file descriptors.
fn require_vmm(dev: &Device) -> Result<()> {
    let caps = dev.capabilities()?;
    if !caps.vmm {
        return Err(Error::Unsupported {
            what: "VMM allocations",
            reason: "the device reports no virtual memory management".into(),
            fix: "use DeviceBuffer (legacy IPC) on this device",
        });
    }
    if !caps.posix_fd_handles {
        return Err(Error::Unsupported {
            what: "VMM export as a file descriptor",
            reason: "the device reports no POSIX file descriptor handles".into(),
            fix: "use DeviceBuffer (legacy IPC) on this device",
        });
    }
    Ok(())
}

/// The recommended allocation granularity of `dev` for fd-exportable memory, in bytes
/// (`cuMemGetAllocationGranularity`); VMM sizes are rounded up to it.
///
/// # Errors
/// [`Error::Cuda`] from the query.
#[doc(alias = "cuMemGetAllocationGranularity")]
pub fn vmm_granularity(dev: &Device) -> Result<usize> {
    granularity(
        &alloc_prop(dev, POSIX_FD),
        sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
    )
}

/// A generic allocation handle mapped at a reserved address range in one context. Drop unmaps the
/// range, frees the address range and releases the handle, in that order; a partly built map undoes
/// only what was done.
#[derive(Debug)]
pub(crate) struct VmmMap {
    pub(crate) ctx: Arc<Context>,
    pub(crate) ptr: u64,
    pub(crate) size: usize,
    pub(crate) handle: sys::CUmemGenericAllocationHandle,
    reserved: bool,
    mapped: bool,
}

impl VmmMap {
    /// Takes ownership of `handle` (released on drop, also when this fails), reserves `size`
    /// bytes, maps the handle there and grants `access` to `ctx`'s device.
    fn map(
        ctx: &Arc<Context>,
        handle: sys::CUmemGenericAllocationHandle,
        size: usize,
        access: Access,
    ) -> Result<VmmMap> {
        let mut m = VmmMap {
            ctx: ctx.clone(),
            ptr: 0,
            size,
            handle,
            reserved: false,
            mapped: false,
        };
        // Declared after `m`, so on failure it drops first and `m`'s drop enters the context anew.
        let _cur = ctx.enter()?;
        let mut ptr = MaybeUninit::<sys::CUdeviceptr>::uninit();
        let t = Instant::now();
        // SAFETY: context current (`_cur`); `ptr` a valid out-pointer; alignment 0 asks for the
        // default (the allocation granularity) and address 0 for any address.
        check("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(ptr.as_mut_ptr(), size, 0, 0, 0)
        })?;
        // SAFETY: written on success.
        m.ptr = unsafe { ptr.assume_init() };
        m.reserved = true;
        let t = cache::lap(ImportStep::Reserve, t);
        // SAFETY: the range [ptr, ptr + size) was just reserved and is unmapped; `handle` is a
        // live allocation handle of at least `size` bytes (the driver checks and fails otherwise).
        check("cuMemMap", unsafe {
            sys::cuMemMap(m.ptr, size, 0, handle, 0)
        })?;
        m.mapped = true;
        let desc = access_desc_for(&ctx.device(), access);
        let t = cache::lap(ImportStep::Map, t);
        // SAFETY: the range is mapped; `desc` is one valid access descriptor.
        check("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(m.ptr, size, &desc, 1)
        })?;
        cache::lap(ImportStep::SetAccess, t);
        Ok(m)
    }
}

impl Drop for VmmMap {
    fn drop(&mut self) {
        let _cur = match self.ctx.enter() {
            Ok(g) => g,
            Err(e) => {
                tracing::warn!("{e}; a VMM mapping of {} bytes stays until exit", self.size);
                return;
            }
        };
        if self.mapped {
            // SAFETY: context current (`_cur`); [ptr, ptr + size) is mapped by this struct alone,
            // and every user of it (buffers, imports) is gone, since they hold this map.
            if let Err(e) = check("cuMemUnmap", unsafe {
                sys::cuMemUnmap(self.ptr, self.size)
            }) {
                tracing::warn!("{e}; a VMM mapping of {} bytes stays until exit", self.size);
                return;
            }
        }
        if self.reserved {
            // SAFETY: the range was reserved by this struct and is no longer mapped.
            if let Err(e) = check("cuMemAddressFree", unsafe {
                sys::cuMemAddressFree(self.ptr, self.size)
            }) {
                tracing::warn!("{e}; {} bytes of address space stay reserved", self.size);
            }
        }
        // SAFETY: the handle is owned by this struct and released once, here.
        if let Err(e) = check("cuMemRelease", unsafe { sys::cuMemRelease(self.handle) }) {
            tracing::warn!("{e}; {} bytes stay allocated until exit", self.size);
        }
    }
}

/// A reserved virtual address range (`cuMemAddressReserve`) at which VMM allocations that are
/// already mapped elsewhere in the same context are mapped in turn, one at a time: a tensor-set
/// reader's stable addresses. [`StableRange::map_from`] finds the allocation behind a mapped
/// address (`cuMemRetainAllocationHandle`), unmaps what the range held (`cuMemUnmap`), maps the
/// allocation there (`cuMemMap`), grants access (`cuMemSetAccess`) and releases the retained
/// handle (`cuMemRelease`: the new mapping holds its own reference to the memory). Drop unmaps the
/// range and frees the reservation (`cuMemAddressFree`).
///
/// The range never outlives what it maps: a mapping holds its physical memory until it is
/// unmapped, whatever happens to the mapping it was found through.
#[derive(Debug)]
pub(crate) struct StableRange {
    ctx: Arc<Context>,
    ptr: u64,
    /// Bytes reserved: a multiple of the device's granularity.
    size: usize,
    /// Bytes mapped from `ptr` now; 0: nothing is mapped.
    mapped: usize,
}

impl StableRange {
    /// Reserves `size` bytes (rounded up to the device's granularity) of address space in `ctx`,
    /// nothing mapped.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for `size == 0` or an overflow; [`Error::Cuda`] naming
    /// `cuMemAddressReserve` (`CUDA_ERROR_OUT_OF_MEMORY` when no range that large is free).
    pub(crate) fn reserve(ctx: &Arc<Context>, size: usize) -> Result<StableRange> {
        let g = vmm_granularity(&ctx.device())?;
        let size = size
            .checked_next_multiple_of(g)
            .filter(|&s| s > 0)
            .ok_or_else(|| Error::InvalidArgument(format!("{size} bytes of address space")))?;
        let _cur = ctx.enter()?;
        let mut ptr = MaybeUninit::<sys::CUdeviceptr>::uninit();
        // SAFETY: context current (`_cur`); `ptr` a valid out-pointer; `size` a multiple of the
        // granularity; alignment 0 asks for the default and address 0 for any address.
        check("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(ptr.as_mut_ptr(), size, 0, 0, 0)
        })?;
        Ok(StableRange {
            ctx: ctx.clone(),
            // SAFETY: written on success.
            ptr: unsafe { ptr.assume_init() },
            size,
            mapped: 0,
        })
    }

    /// The first address of the range, the same for the range's life.
    pub(crate) fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Maps the first `len` bytes (a multiple of the granularity, at most the reservation) of
    /// the VMM allocation that is mapped at `source` in this context (any address inside that
    /// mapping) at this range, with `access`, in place of what the range held. The caller
    /// guarantees that no work of the context still uses the range (it is unmapped first). On an
    /// error the range is left with nothing mapped.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `len` exceeds the reservation; [`Error::Cuda`] naming
    /// `cuMemRetainAllocationHandle` (`source` is not a VMM mapping), `cuMemUnmap`, `cuMemMap`
    /// (`len` past the allocation) or `cuMemSetAccess`.
    pub(crate) fn map_from(&mut self, source: u64, len: usize, access: Access) -> Result<()> {
        if len == 0 || len > self.size {
            return Err(Error::InvalidArgument(format!(
                "{len} bytes do not fit a stable range of {} bytes",
                self.size
            )));
        }
        // A clone: the guard borrows it while `self` is borrowed mutably.
        let ctx = self.ctx.clone();
        let _cur = ctx.enter()?;
        let mut h = MaybeUninit::<sys::CUmemGenericAllocationHandle>::uninit();
        // SAFETY: context current (`_cur`); `h` a valid out-pointer; the driver only looks the
        // address up (it fails for an address no `cuMemMap` mapped).
        check("cuMemRetainAllocationHandle", unsafe {
            sys::cuMemRetainAllocationHandle(
                h.as_mut_ptr(),
                source as usize as *mut std::ffi::c_void,
            )
        })?;
        // SAFETY: written on success.
        let h = unsafe { h.assume_init() };
        let r = self.unmap_current().and_then(|()| {
            // SAFETY: [ptr, ptr + len) lies in this range's reservation (checked above) and is
            // unmapped (just above); `h` is a live handle (retained) of an allocation the driver
            // checks to hold at least `len` bytes from offset 0.
            check("cuMemMap", unsafe { sys::cuMemMap(self.ptr, len, 0, h, 0) })?;
            self.mapped = len;
            let desc = access_desc_for(&self.ctx.device(), access);
            // SAFETY: the range is mapped (just above); `desc` is one valid access descriptor.
            check("cuMemSetAccess", unsafe {
                sys::cuMemSetAccess(self.ptr, len, &desc, 1)
            })?;
            Ok(())
        });
        // SAFETY: `h` was retained above and is released once, here; a mapping made from it keeps
        // its own reference to the memory.
        let released = check("cuMemRelease", unsafe { sys::cuMemRelease(h) });
        if let Err(e) = r {
            let _ = self.unmap_current();
            return Err(e);
        }
        if let Err(e) = released {
            tracing::warn!("{e}; the retained handle's reference stays until exit");
        }
        Ok(())
    }

    /// Unmaps what the range holds (`cuMemUnmap`), if anything; the reservation stays. The caller
    /// guarantees that no work of the context still uses the range.
    ///
    /// # Errors
    /// [`Error::Cuda`] naming `cuMemUnmap` (the range then stays mapped).
    pub(crate) fn unmap(&mut self) -> Result<()> {
        let ctx = self.ctx.clone();
        let _cur = ctx.enter()?;
        self.unmap_current()
    }

    /// As [`StableRange::unmap`], with the context current.
    fn unmap_current(&mut self) -> Result<()> {
        if self.mapped == 0 {
            return Ok(());
        }
        // SAFETY: the caller made the context current; [ptr, ptr + mapped) is exactly what
        // `map_from` mapped (a whole mapping, as `cuMemUnmap` requires); the caller guarantees no
        // work still uses it.
        check("cuMemUnmap", unsafe {
            sys::cuMemUnmap(self.ptr, self.mapped)
        })?;
        self.mapped = 0;
        Ok(())
    }
}

impl Drop for StableRange {
    fn drop(&mut self) {
        let ctx = self.ctx.clone();
        let _cur = match ctx.enter() {
            Ok(g) => g,
            Err(e) => {
                tracing::warn!("{e}; {} bytes of address space stay reserved", self.size);
                return;
            }
        };
        if let Err(e) = self.unmap_current() {
            tracing::warn!("{e}; a stable range of {} bytes stays mapped", self.size);
            return;
        }
        // SAFETY: the range was reserved by this value and nothing is mapped in it any more.
        if let Err(e) = check("cuMemAddressFree", unsafe {
            sys::cuMemAddressFree(self.ptr, self.size)
        }) {
            tracing::warn!("{e}; {} bytes of address space stay reserved", self.size);
        }
    }
}

/// The exporter's side of a VMM allocation, shared between a [`VmmBuffer`] and self-imports.
#[derive(Debug)]
pub(crate) struct VmmAllocation {
    // Drop order: the fd export is withdrawn before the map is torn down.
    export: Mutex<Option<FdExport>>,
    pub(crate) map: VmmMap,
    pub(crate) len: usize,
}

/// Device memory from `cuMemCreate` with POSIX file descriptor handles, mapped and accessible in its
/// context. `len` is what was asked for, in bytes; the allocation is rounded up to the device's
/// granularity ([`VmmBuffer::allocation_size`]).
///
/// Export it with [`VmmBuffer::export`] (a token whose file descriptor other processes fetch from
/// this one) or [`VmmBuffer::export_fd`] (a descriptor for your own transport). Importers hold their
/// own reference to the memory: it stays valid for them after this buffer drops or this process
/// exits. Drop unmaps, releases the handle and frees the address range.
///
/// See <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html>.
#[derive(Debug, Clone)]
pub struct VmmBuffer {
    pub(crate) alloc: Arc<VmmAllocation>,
}

impl VmmBuffer {
    /// Allocates `len` bytes (rounded up to the granularity), exportable as a POSIX fd, mapped
    /// read/write in `ctx` (`cuMemCreate`, `cuMemAddressReserve`, `cuMemMap`, `cuMemSetAccess`).
    /// Contents are uninitialised.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for `len == 0`; [`Error::Unsupported`] when the device has no VMM
    /// or no POSIX fd handles; [`Error::Cuda`] (`CUDA_ERROR_OUT_OF_MEMORY`, ...). Nothing is leaked
    /// on failure.
    #[doc(alias = "cuMemCreate")]
    pub fn new(ctx: &Arc<Context>, len: usize) -> Result<VmmBuffer> {
        if len == 0 {
            return Err(Error::InvalidArgument(
                "a VMM buffer needs at least 1 byte".into(),
            ));
        }
        let dev = ctx.device();
        require_vmm(&dev)?;
        let _cur = ctx.enter()?;
        let g = vmm_granularity(&dev)?;
        let size = len
            .checked_next_multiple_of(g)
            .ok_or_else(|| Error::InvalidArgument(format!("{len} bytes overflow")))?;
        let prop = alloc_prop(&dev, POSIX_FD);
        let mut h = MaybeUninit::<sys::CUmemGenericAllocationHandle>::uninit();
        // SAFETY: context current (`_cur`); `prop` fully initialised; `size` a multiple of the
        // granularity.
        check("cuMemCreate", unsafe {
            sys::cuMemCreate(h.as_mut_ptr(), size, &prop, 0)
        })?;
        // SAFETY: written on success.
        let map = VmmMap::map(ctx, unsafe { h.assume_init() }, size, Access::ReadWrite)?;
        Ok(VmmBuffer {
            alloc: Arc::new(VmmAllocation {
                export: Mutex::new(None),
                map,
                len,
            }),
        })
    }

    /// Size of the physical allocation in bytes (the requested length rounded up to the
    /// granularity).
    pub fn allocation_size(&self) -> usize {
        self.alloc.map.size
    }

    /// A new file descriptor for the allocation (`cuMemExportToShareableHandle`), for a transport of
    /// your own; you own it. Import it with
    /// [`ImportedBuffer::from_vmm_fd`](super::ImportedBuffer::from_vmm_fd).
    ///
    /// # Errors
    /// [`Error::Cuda`] from the export.
    #[doc(alias = "cuMemExportToShareableHandle")]
    pub fn export_fd(&self) -> Result<OwnedFd> {
        let _cur = self.alloc.map.ctx.enter()?;
        let mut fd: i32 = -1;
        // SAFETY: context current (`_cur`); the handle is live (owned by the map); for POSIX fd
        // handles the out-parameter is one `int`.
        check("cuMemExportToShareableHandle", unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut fd as *mut i32).cast(),
                self.alloc.map.handle,
                POSIX_FD,
                0,
            )
        })?;
        if fd < 0 {
            return Err(Error::InvalidArgument(format!(
                "the driver exported file descriptor {fd}"
            )));
        }
        // SAFETY: the driver returned a new descriptor that nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// A token for the whole buffer. See [`VmmBuffer::export_range`].
    ///
    /// # Errors
    /// As [`VmmBuffer::export_range`].
    pub fn export(&self) -> Result<Token> {
        self.export_range(0, self.len())
    }

    /// A token for bytes `offset..offset + len`. The first export offers the allocation's file
    /// descriptor to other processes of this user through [`super::fdpass`] (kept until this
    /// buffer and its clones drop); importers fetch it with the token.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the range leaves the buffer; [`Error::Cuda`] from the export;
    /// [`Error::Os`] when the fd server cannot start.
    pub fn export_range(&self, offset: usize, len: usize) -> Result<Token> {
        crate::driver::memory_check_range(offset, len, self.len())?;
        let (id, raw) = {
            let mut ex = lock(&self.alloc.export);
            if ex.is_none() {
                let e = FdExport::new(self.export_fd()?)?;
                let mut local = lock(&LOCAL_VMM);
                local.retain(|_, w| w.strong_count() > 0);
                local.insert(e.id(), Arc::downgrade(&self.alloc));
                *ex = Some(e);
            }
            let e = ex.as_ref().expect("set above");
            (e.id(), e.raw_fd())
        };
        let mut handle = [0u8; 64];
        handle[..4].copy_from_slice(&raw.to_le_bytes());
        handle[8..16].copy_from_slice(&(self.alloc.map.size as u64).to_le_bytes());
        Ok(Token {
            kind: TokenKind::VmmMemory,
            handle,
            offset: offset as u64,
            len: len as u64,
            device: self.alloc.map.ctx.device().uuid(),
            exporter: ProcessIdentity::current()?,
            export_id: id,
        })
    }
}

impl DeviceMemory for VmmBuffer {
    fn device_ptr(&self) -> u64 {
        self.alloc.map.ptr
    }
    fn len(&self) -> usize {
        self.alloc.len
    }
    fn context(&self) -> &Arc<Context> {
        &self.alloc.map.ctx
    }
}

/// Imports the allocation behind `fd` (`cuMemImportFromShareableHandle`) and maps `size` bytes of
/// it in `ctx`. The descriptor is borrowed: the caller keeps it and closes it, whatever the result.
fn import_vmm_handle(
    ctx: &Arc<Context>,
    fd: BorrowedFd<'_>,
    size: usize,
    access: Access,
) -> Result<VmmMap> {
    let _cur = ctx.enter()?;
    let mut h = MaybeUninit::<sys::CUmemGenericAllocationHandle>::uninit();
    let t = Instant::now();
    // SAFETY: context current (`_cur`); for POSIX fd handles the OS handle is the descriptor's
    // value passed as a pointer-sized integer; the driver does not take ownership of the
    // descriptor.
    check("cuMemImportFromShareableHandle", unsafe {
        sys::cuMemImportFromShareableHandle(
            h.as_mut_ptr(),
            fd.as_raw_fd() as usize as *mut std::ffi::c_void,
            POSIX_FD,
        )
    })?;
    cache::add_import_time(ImportStep::Import, t.elapsed());
    cache::count_open();
    // SAFETY: written on success.
    VmmMap::map(ctx, unsafe { h.assume_init() }, size, access)
}

/// Opens (or finds in the cache) the mapping a VMM token names, in `ctx`. The fd fetch ([`fetch_fd`],
/// up to its timeout) runs inside the key's single-flight open: other threads importing the same
/// token wait for it, imports of other keys do not. `fetched`: the allocation's fd when the caller
/// fetched it already (a batched import), used instead of a fetch if this call opens the mapping,
/// else closed unused; closed (dropped) right after the import either way.
/// `access` is the importer's ([`Access::ReadOnly`]: mapped `PROT_READ`); a self-import is the
/// exporter's own read-write mapping. A token that names this process but an export id not in
/// the table of its own VMM buffers (an allocation it imported and serves again, as a resumed
/// tensor set's writer does) is imported from a copy of the fd it serves under that id
/// (`fdpass::own_offered`), as another process's would be.
///
/// # Errors
/// [`Error::InvalidArgument`] for this process's own buffer in another context, one it freed, or
/// an export id it no longer offers; fetch and CUDA errors of the import otherwise.
pub(crate) fn open_vmm(
    ctx: &Arc<Context>,
    token: &Token,
    access: Access,
    fetched: Option<OwnedFd>,
) -> Result<Arc<Mapping>> {
    let raw_fd = i32::from_le_bytes(token.handle[..4].try_into().unwrap_or_default());
    let size = u64::from_le_bytes(token.handle[8..16].try_into().unwrap_or_default());
    let size = usize::try_from(size)
        .ok()
        .filter(|&s| s > 0)
        .ok_or_else(|| Error::InvalidToken(format!("VMM allocation size {size}")))?;
    let is_self = token.exporter.is_current()?;
    let key = MappingKey::of(token, ctx, access);
    let (m, how) = cache::MAPPINGS.get_or_open(key, |lease| {
        let local = if is_self {
            lock(&LOCAL_VMM).get(&token.export_id).map(Weak::upgrade)
        } else {
            None
        };
        let (origin, base, size, read_only) = match local {
            Some(Some(a)) if a.map.ctx.as_raw() == ctx.as_raw() => {
                cache::count_self_import();
                let (base, size) = (a.map.ptr, a.map.size);
                (Origin::local(Box::new(a)), base, size, false)
            }
            Some(Some(_)) => {
                return Err(Error::InvalidArgument(
                    "a VMM buffer of this process can only be self-imported in its own context"
                        .into(),
                ));
            }
            Some(None) => {
                return Err(Error::InvalidArgument(
                    "the token names a VMM buffer this process exported and has since freed".into(),
                ));
            }
            None => {
                // Another process's allocation, or one this process serves without having made
                // it (a resumed tensor set's import of a holder's fd): imported from an fd, the
                // own export table's copy for the latter.
                require_peer(ctx, token.device)?;
                let fd = match (fetched, is_self) {
                    (Some(fd), _) => fd,
                    (None, false) => fetch_fd(token, raw_fd)?,
                    (None, true) => own_offered(token.export_id)?.ok_or_else(|| {
                        Error::InvalidArgument(format!(
                            "the token names export {} of this process, which it no longer offers",
                            token.export_id
                        ))
                    })?,
                };
                // `fd` is closed right after the import (timed), or when it drops on failure.
                let vm = import_vmm_handle(ctx, fd.as_fd(), size, access)?;
                let t = Instant::now();
                drop(fd);
                cache::lap(ImportStep::CloseFd, t);
                let (base, size) = (vm.ptr, vm.size);
                let ro = access == Access::ReadOnly;
                (Origin::closed_by(Box::new(vm)), base, size, ro)
            }
        };
        Ok(Mapping {
            base,
            size,
            read_only,
            origin,
            ctx: ctx.clone(),
            _lease: Some(lease),
        })
    })?;
    cache::count_served(how);
    Ok(m)
}

/// A mapping of the VMM allocation behind `fd`, `size` bytes in `ctx`, kept out of the cache (for
/// [`super::ImportedBuffer::from_vmm_fd`]). The descriptor stays the caller's.
pub(crate) fn uncached_vmm_mapping(
    ctx: &Arc<Context>,
    fd: BorrowedFd<'_>,
    size: usize,
    access: Access,
) -> Result<Mapping> {
    let vm = import_vmm_handle(ctx, fd, size, access)?;
    let (base, size) = (vm.ptr, vm.size);
    Ok(Mapping {
        base,
        size,
        read_only: access == Access::ReadOnly,
        origin: Origin::closed_by(Box::new(vm)),
        ctx: ctx.clone(),
        _lease: None,
    })
}

/// Whether `dev` can export FABRIC handles (multi-node NVLink through IMEX): tries a one-granule
/// allocation with `CU_MEM_HANDLE_TYPE_FABRIC` and frees it. `Err` carries the reason it cannot
/// (the device attribute, or the driver's refusal such as `CUDA_ERROR_NOT_PERMITTED` without an
/// IMEX daemon). This crate shares memory within one host through POSIX fds, which need neither.
pub fn fabric_handles(dev: &Device) -> std::result::Result<(), String> {
    let caps = dev.capabilities().map_err(|e| e.to_string())?;
    if !caps.fabric_handles {
        return Err("the device reports no fabric handle support".into());
    }
    let ctx = dev.primary_context().map_err(|e| e.to_string())?;
    let fabric = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC;
    let prop = alloc_prop(dev, fabric);
    let mut g = MaybeUninit::<usize>::uninit();
    let _cur = ctx.enter().map_err(|e| e.to_string())?;
    // SAFETY: context current (`_cur`); `prop` fully initialised; `g` a valid out-pointer.
    check("cuMemGetAllocationGranularity", unsafe {
        sys::cuMemGetAllocationGranularity(
            g.as_mut_ptr(),
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
    })
    .map_err(|e| e.to_string())?;
    // SAFETY: written on success.
    let g = unsafe { g.assume_init() }.max(1);
    let mut h = MaybeUninit::<sys::CUmemGenericAllocationHandle>::uninit();
    // SAFETY: context current (`_cur`); `prop` fully initialised; `g` the granularity.
    check("cuMemCreate", unsafe {
        sys::cuMemCreate(h.as_mut_ptr(), g, &prop, 0)
    })
    .map_err(|e| format!("{e} (FABRIC handles need an IMEX daemon and channel)"))?;
    // SAFETY: written on success.
    let h = unsafe { h.assume_init() };
    let mut out = [0u8; 64];
    // SAFETY: live handle; a fabric handle is 64 bytes, `out` holds them.
    let r = check("cuMemExportToShareableHandle", unsafe {
        sys::cuMemExportToShareableHandle(out.as_mut_ptr().cast(), h, fabric, 0)
    });
    // SAFETY: the handle was created above and is released once.
    let _ = unsafe { sys::cuMemRelease(h) };
    r.map_err(|e| format!("{e} (FABRIC handles need an IMEX daemon and channel)"))
}
