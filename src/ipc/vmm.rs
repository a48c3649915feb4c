//! VMM allocations (`cuMemCreate`) shared as POSIX file descriptors, and exportable stream-ordered
//! memory pools (`cuMemPoolCreate`), the route NCCL and PyTorch's expandable segments take.
//!
//! Owns: [`VmmBuffer`] and [`MemPool`]/[`PoolBuffer`] on the exporting side, the importer's
//! mappings of both (reserve, import, map, set access; teardown in the reverse order), and the
//! process-wide choice of fd transport ([`set_fd_transport`]). File descriptors travel through
//! [`super::fdpass`]; the import cache is [`super::cache`].
//!
//! Unlike a legacy `IpcMemHandle`, an imported VMM allocation holds its own reference to the physical
//! memory: it stays valid when the exporter frees it or dies, until the importer drops it.
//!
//! Who closes a file descriptor: the exporter's copy belongs to its [`super::fdpass::FdExport`]
//! (closed when the buffer or pool drops); an importer's copy is closed by this module right after
//! `cuMemImportFromShareableHandle` / `cuMemPoolImportFromShareableHandle`, on success and on
//! failure (the driver does not take ownership of it). An fd passed to
//! [`super::ImportedBuffer::from_vmm_fd`] stays the caller's.
//!
//! The self-import tables of VMM and pool exports, the imported pools and the table of exportable
//! pools (which `foreign.rs` consults to classify pool pointers) live here, beside their kinds;
//! mappings go into the cache as opaque keep-alives, so the cache names none of these types.
//!
//! See <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html> and
//! <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html>.

use super::cache::{self, Mapping, MappingKey, Origin, lock};
use super::fdpass::{self, FdExport, FdTransport};
use super::flight::{Lease, SingleFlight};
use crate::driver::{Context, Device, DeviceMemory, Stream};
use crate::error::{Error, Result};
use crate::ffi::{check, sys};
use crate::identity::ProcessIdentity;
use crate::token::{Token, TokenKind};
use std::collections::{BTreeMap, HashMap};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

/// How long an import waits for the exporter to hand over a file descriptor.
const FETCH_TIMEOUT: Duration = Duration::from_secs(5);

static TRANSPORT: Mutex<Option<FdTransport>> = Mutex::new(None);

/// VMM exports of this process: fd export id → allocation (for self-imports).
static LOCAL_VMM: Mutex<BTreeMap<u32, Weak<VmmAllocation>>> = Mutex::new(BTreeMap::new());

/// Pool exports of this process: pointer export data → allocation (for self-imports).
static LOCAL_POOL: Mutex<BTreeMap<[u8; 64], Weak<PoolAllocation>>> = Mutex::new(BTreeMap::new());

/// Key of an imported pool: the exporter (full identity), the pool's fd export id, and the
/// importing context's address.
type PoolKey = (ProcessIdentity, u32, usize);

/// Pools imported by this process (a single-flight table, as the mappings in `cache.rs`).
static IMPORTED_POOLS: SingleFlight<PoolKey, ImportedPool> = SingleFlight::new();

/// This process's exportable pools by raw `CUmemoryPool` address, for classifying foreign pointers
/// (`foreign.rs`). Entries of dropped pools are pruned on the next registration.
static POOLS: Mutex<Option<HashMap<usize, Weak<PoolInner>>>> = Mutex::new(None);

/// Enters a pool made by [`MemPool::exportable`] in the table of exportable pools.
fn register_pool(inner: &Arc<PoolInner>) {
    let mut t = lock(&POOLS);
    let t = t.get_or_insert_with(HashMap::new);
    t.retain(|_, w| w.strong_count() > 0);
    t.insert(inner.pool as usize, Arc::downgrade(inner));
}

/// The live exportable pool of this process whose raw `CUmemoryPool` is `raw`, if any.
pub(crate) fn our_pool(raw: usize) -> Option<Arc<PoolInner>> {
    lock(&POOLS).as_ref()?.get(&raw)?.upgrade()
}

/// Sets how this process fetches the file descriptors of VMM and pool tokens it imports:
/// [`FdTransport::Socket`] (the default: SCM_RIGHTS over the exporter's Unix socket, needs no
/// special rights), or `pidfd_getfd(2)` first ([`FdTransport::PidfdThenSocket`], needs ptrace
/// rights over the exporter). Without a call, the environment variable `CUDA_IPC_FD_TRANSPORT`
/// (`socket`, `pidfd`, `pidfd-only`) decides.
pub fn set_fd_transport(t: FdTransport) {
    *lock(&TRANSPORT) = Some(t);
}

/// The transport imports use now (see [`set_fd_transport`]).
pub fn fd_transport() -> FdTransport {
    let mut t = lock(&TRANSPORT);
    *t.get_or_insert_with(|| match std::env::var("CUDA_IPC_FD_TRANSPORT").as_deref() {
        Ok("pidfd") => FdTransport::PidfdThenSocket,
        Ok("pidfd-only") => FdTransport::PidfdOnly,
        _ => FdTransport::Socket,
    })
}

fn location(dev: &Device) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: dev.raw(),
    }
}

fn access_desc(dev: &Device) -> sys::CUmemAccessDesc {
    sys::CUmemAccessDesc {
        location: location(dev),
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    }
}

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

const POSIX_FD: sys::CUmemAllocationHandleType =
    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;

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
    let prop = alloc_prop(dev, POSIX_FD);
    let mut g = MaybeUninit::<usize>::uninit();
    // SAFETY: driver loaded (a Device exists); `prop` is a fully initialised property struct;
    // `g` a valid out-pointer.
    check("cuMemGetAllocationGranularity", unsafe {
        sys::cuMemGetAllocationGranularity(
            g.as_mut_ptr(),
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
        )
    })?;
    // SAFETY: written on success.
    Ok(unsafe { g.assume_init() }.max(1))
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
    /// bytes, maps the handle there and grants read/write access to `ctx`'s device.
    fn map(
        ctx: &Arc<Context>,
        handle: sys::CUmemGenericAllocationHandle,
        size: usize,
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
        // SAFETY: context current (`_cur`); `ptr` a valid out-pointer; alignment 0 asks for the
        // default (the allocation granularity) and address 0 for any address.
        check("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(ptr.as_mut_ptr(), size, 0, 0, 0)
        })?;
        // SAFETY: written on success.
        m.ptr = unsafe { ptr.assume_init() };
        m.reserved = true;
        // SAFETY: the range [ptr, ptr + size) was just reserved and is unmapped; `handle` is a
        // live allocation handle of at least `size` bytes (the driver checks and fails otherwise).
        check("cuMemMap", unsafe {
            sys::cuMemMap(m.ptr, size, 0, handle, 0)
        })?;
        m.mapped = true;
        let desc = access_desc(&ctx.device());
        // SAFETY: the range is mapped; `desc` is one valid access descriptor.
        check("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(m.ptr, size, &desc, 1)
        })?;
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
        let map = VmmMap::map(ctx, unsafe { h.assume_init() }, size)?;
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

/// Fails with a clear error when `ctx`'s device cannot reach memory on the device `owner`.
fn require_peer(ctx: &Arc<Context>, owner: crate::driver::Uuid) -> Result<()> {
    let here = ctx.device();
    if here.uuid() == owner {
        return Ok(());
    }
    let Ok(dev) = Device::by_uuid(owner) else {
        // Not visible here: the driver's own mapping call decides.
        return Ok(());
    };
    let mut ok = 0i32;
    // SAFETY: both are valid device handles of a loaded driver; `ok` a valid out-pointer.
    check("cuDeviceCanAccessPeer", unsafe {
        sys::cuDeviceCanAccessPeer(&mut ok, here.raw(), dev.raw())
    })?;
    if ok == 0 {
        return Err(Error::Unsupported {
            what: "importing memory of another GPU",
            reason: format!(
                "device {} cannot access device {owner} (no peer access)",
                here.uuid()
            ),
            fix: "import on the device that holds the memory",
        });
    }
    Ok(())
}

fn fetch_fd(token: &Token, raw_fd: i32) -> Result<OwnedFd> {
    let transport = if raw_fd < 0 {
        FdTransport::Socket
    } else {
        fd_transport()
    };
    let fd = fdpass::fetch(
        &token.exporter,
        token.export_id,
        raw_fd,
        transport,
        FETCH_TIMEOUT,
    )?;
    cache::bump(&cache::FD_FETCHES);
    Ok(fd)
}

fn import_vmm_handle(ctx: &Arc<Context>, fd: BorrowedFd<'_>, size: usize) -> Result<VmmMap> {
    let _cur = ctx.enter()?;
    let mut h = MaybeUninit::<sys::CUmemGenericAllocationHandle>::uninit();
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
    cache::count_open();
    // SAFETY: written on success.
    VmmMap::map(ctx, unsafe { h.assume_init() }, size)
}

/// Opens (or finds in the cache) the mapping a VMM token names, in `ctx`. The fd fetch (up to
/// [`FETCH_TIMEOUT`]) runs inside the key's single-flight open: other threads importing the same
/// token wait for it, imports of other keys do not.
pub(crate) fn open_vmm(ctx: &Arc<Context>, token: &Token) -> Result<Arc<Mapping>> {
    let raw_fd = i32::from_le_bytes(token.handle[..4].try_into().unwrap_or_default());
    let size = u64::from_le_bytes(token.handle[8..16].try_into().unwrap_or_default());
    let size = usize::try_from(size)
        .ok()
        .filter(|&s| s > 0)
        .ok_or_else(|| Error::InvalidToken(format!("VMM allocation size {size}")))?;
    let is_self = token.exporter == ProcessIdentity::current()?;
    let key = MappingKey::of(token, ctx);
    let (m, how) = cache::MAPPINGS.get_or_open(key, |lease| {
        let (origin, base, size) = if is_self {
            let local = lock(&LOCAL_VMM).get(&token.export_id).map(Weak::upgrade);
            match local {
                Some(Some(a)) if a.map.ctx.as_raw() == ctx.as_raw() => {
                    cache::count_self_import();
                    let (base, size) = (a.map.ptr, a.map.size);
                    (Origin::local(Box::new(a)), base, size)
                }
                Some(Some(_)) => {
                    return Err(Error::InvalidArgument(
                        "a VMM buffer of this process can only be self-imported in its own context"
                            .into(),
                    ));
                }
                _ => {
                    return Err(Error::InvalidArgument(
                        "the token names a VMM buffer this process exported and has since freed"
                            .into(),
                    ));
                }
            }
        } else {
            require_peer(ctx, token.device)?;
            let fd = fetch_fd(token, raw_fd)?;
            // `fd` is closed when it drops at the end of this block, on success and on failure.
            let vm = import_vmm_handle(ctx, fd.as_fd(), size)?;
            let (base, size) = (vm.ptr, vm.size);
            (Origin::closed_by(Box::new(vm)), base, size)
        };
        Ok(Mapping {
            base,
            size,
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
) -> Result<Mapping> {
    let vm = import_vmm_handle(ctx, fd, size)?;
    let (base, size) = (vm.ptr, vm.size);
    Ok(Mapping {
        base,
        size,
        origin: Origin::closed_by(Box::new(vm)),
        ctx: ctx.clone(),
        _lease: None,
    })
}

// ------------------------------------------------------------------------------------------ pools

/// An exportable stream-ordered memory pool, created by this process.
#[derive(Debug)]
pub(crate) struct PoolInner {
    // Drop order: the fd export is withdrawn, then the pool destroyed (in Drop), then the context.
    pub(crate) export: FdExport,
    pub(crate) pool: sys::CUmemoryPool,
    pub(crate) ctx: Arc<Context>,
}

// SAFETY: a CUmemoryPool is a driver handle usable from any thread of the process.
unsafe impl Send for PoolInner {}
// SAFETY: as for Send; the pointer is never dereferenced here.
unsafe impl Sync for PoolInner {}

impl Drop for PoolInner {
    fn drop(&mut self) {
        let r = self.ctx.enter().and_then(|_cur| {
            // SAFETY: context current (`_cur`); the pool was created here and is destroyed once;
            // every allocation from it holds this struct, so none is left.
            check("cuMemPoolDestroy", unsafe {
                sys::cuMemPoolDestroy(self.pool)
            })
            .map_err(Into::into)
        });
        if let Err(e) = r {
            tracing::warn!("{e}; a memory pool stays until exit");
        }
    }
}

/// A stream-ordered memory pool whose allocations other processes can import
/// (`cuMemPoolCreate` with POSIX file descriptor handles). Its fd is offered to other processes of
/// this user through [`super::fdpass`] while the pool lives.
///
/// See <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html>.
#[derive(Debug, Clone)]
pub struct MemPool {
    pub(crate) inner: Arc<PoolInner>,
}

impl MemPool {
    /// Creates an exportable pool on `ctx`'s device and offers its fd
    /// (`cuMemPoolCreate`, `cuMemPoolExportToShareableHandle`).
    ///
    /// # Errors
    /// [`Error::Unsupported`] when the device has no memory pools or no POSIX fd handles;
    /// [`Error::Cuda`]; [`Error::Os`] when the fd server cannot start.
    #[doc(alias = "cuMemPoolCreate")]
    pub fn exportable(ctx: &Arc<Context>) -> Result<MemPool> {
        let dev = ctx.device();
        let caps = dev.capabilities()?;
        if !caps.memory_pools || !caps.posix_fd_handles {
            return Err(Error::Unsupported {
                what: "exportable memory pools",
                reason: format!(
                    "memory pools: {}, POSIX fd handles: {}",
                    caps.memory_pools, caps.posix_fd_handles
                ),
                fix: "use DeviceBuffer (legacy IPC) or VmmBuffer on this device",
            });
        }
        let props = sys::CUmemPoolProps {
            allocType: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
            handleTypes: POSIX_FD,
            location: location(&dev),
            win32SecurityAttributes: std::ptr::null_mut(),
            maxSize: 0,
            usage: 0,
            reserved: [0; 54],
        };
        let _cur = ctx.enter()?;
        let mut pool = MaybeUninit::<sys::CUmemoryPool>::uninit();
        // SAFETY: context current (`_cur`); `props` fully initialised; `pool` a valid out-pointer.
        check("cuMemPoolCreate", unsafe {
            sys::cuMemPoolCreate(pool.as_mut_ptr(), &props)
        })?;
        // SAFETY: written on success.
        let pool = unsafe { pool.assume_init() };
        let destroy = |e: Error| {
            // SAFETY: the pool was created above and nothing was allocated from it.
            let _ = unsafe { sys::cuMemPoolDestroy(pool) };
            e
        };
        let mut fd: i32 = -1;
        // SAFETY: context current (`_cur`); live pool created with POSIX fd handles; the
        // out-parameter is one `int` for this handle type.
        check("cuMemPoolExportToShareableHandle", unsafe {
            sys::cuMemPoolExportToShareableHandle((&mut fd as *mut i32).cast(), pool, POSIX_FD, 0)
        })
        .map_err(|e| destroy(e.into()))?;
        if fd < 0 {
            return Err(destroy(Error::InvalidArgument(format!(
                "the driver exported file descriptor {fd}"
            ))));
        }
        // SAFETY: a new descriptor from the driver that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let export = FdExport::new(fd).map_err(destroy)?;
        let inner = Arc::new(PoolInner {
            export,
            pool,
            ctx: ctx.clone(),
        });
        // Known to `ipc::foreign`, so memory other libraries allocate from it can be exported.
        register_pool(&inner);
        Ok(MemPool { inner })
    }

    /// Allocates `len` bytes from the pool on `stream` (`cuMemAllocFromPoolAsync`) and waits for
    /// the allocation to complete, so the buffer can be exported at once (importers must not touch
    /// it before its allocation completed).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for `len == 0` or a stream of another context; [`Error::Cuda`].
    #[doc(alias = "cuMemAllocFromPoolAsync")]
    pub fn alloc(&self, len: usize, stream: &Stream) -> Result<PoolBuffer> {
        if len == 0 {
            return Err(Error::InvalidArgument(
                "a pool buffer needs at least 1 byte".into(),
            ));
        }
        stream.context().same_as(&self.inner.ctx)?;
        let _cur = self.inner.ctx.enter()?;
        let mut ptr = MaybeUninit::<sys::CUdeviceptr>::uninit();
        // SAFETY: context current (`_cur`); live pool and stream of this context; `ptr` a valid
        // out-pointer.
        check("cuMemAllocFromPoolAsync", unsafe {
            sys::cuMemAllocFromPoolAsync(ptr.as_mut_ptr(), len, self.inner.pool, stream.as_raw())
        })?;
        let buf = PoolBuffer {
            alloc: Arc::new(PoolAllocation {
                // SAFETY: written on success.
                ptr: unsafe { ptr.assume_init() },
                len,
                export_data: Mutex::new(None),
                pool: self.inner.clone(),
            }),
        };
        stream.synchronize()?;
        Ok(buf)
    }
}

/// One allocation from an exportable pool, freed when the last holder goes.
#[derive(Debug)]
pub(crate) struct PoolAllocation {
    pub(crate) ptr: sys::CUdeviceptr,
    pub(crate) len: usize,
    export_data: Mutex<Option<[u8; 64]>>,
    pool: Arc<PoolInner>,
}

impl Drop for PoolAllocation {
    fn drop(&mut self) {
        let ctx = &self.pool.ctx;
        let r = ctx.enter().and_then(|_cur| {
            // SAFETY: context current (`_cur`).
            check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })?;
            // SAFETY: `ptr` came from cuMemAllocFromPoolAsync and is freed once, after all work
            // queued in the context finished; importers released it first (the caller's contract).
            check("cuMemFree_v2", unsafe { sys::cuMemFree_v2(self.ptr) })?;
            Ok(())
        });
        if let Err(e) = r {
            tracing::warn!("{e}; {} bytes stay allocated in their pool", self.len);
        }
    }
}

/// Device memory allocated from a [`MemPool`]. `len` in bytes. Export it with
/// [`PoolBuffer::export`]; importers must drop their imports before this buffer is freed here
/// (the channel and the registry's users arrange that through holds).
#[derive(Debug, Clone)]
pub struct PoolBuffer {
    pub(crate) alloc: Arc<PoolAllocation>,
}

impl PoolBuffer {
    /// A token for the whole buffer: the pointer's export data (`cuMemPoolExportPointer`) and the
    /// id under which the pool's fd is served.
    ///
    /// # Errors
    /// [`Error::Cuda`] from the export.
    #[doc(alias = "cuMemPoolExportPointer")]
    pub fn export(&self) -> Result<Token> {
        let data = {
            let mut d = lock(&self.alloc.export_data);
            match *d {
                Some(d) => d,
                None => {
                    let _cur = self.alloc.pool.ctx.enter()?;
                    let mut out = MaybeUninit::<sys::CUmemPoolPtrExportData>::uninit();
                    // SAFETY: context current (`_cur`); `ptr` is a live allocation of an exportable
                    // pool; `out` a valid out-pointer.
                    check("cuMemPoolExportPointer", unsafe {
                        sys::cuMemPoolExportPointer(out.as_mut_ptr(), self.alloc.ptr)
                    })?;
                    // SAFETY: written on success.
                    let bytes = unsafe { out.assume_init() }.reserved;
                    let mut local = lock(&LOCAL_POOL);
                    local.retain(|_, w| w.strong_count() > 0);
                    local.insert(bytes, Arc::downgrade(&self.alloc));
                    *d = Some(bytes);
                    bytes
                }
            }
        };
        Ok(Token {
            kind: TokenKind::PoolMemory,
            handle: data,
            offset: 0,
            len: self.alloc.len as u64,
            device: self.alloc.pool.ctx.device().uuid(),
            exporter: ProcessIdentity::current()?,
            export_id: self.alloc.pool.export.id(),
        })
    }
}

impl DeviceMemory for PoolBuffer {
    fn device_ptr(&self) -> u64 {
        self.alloc.ptr
    }
    fn len(&self) -> usize {
        self.alloc.len
    }
    fn context(&self) -> &Arc<Context> {
        &self.alloc.pool.ctx
    }
}

/// A pool imported from another process (`cuMemPoolImportFromShareableHandle`), shared by the
/// pointers imported from it.
#[derive(Debug)]
pub(crate) struct ImportedPool {
    pool: sys::CUmemoryPool,
    // Drop order: the pool is destroyed (in Drop), then the context released, then the lease frees
    // the cache key (the next import of the pool opens only after this destroy).
    ctx: Arc<Context>,
    _lease: Lease<PoolKey, ImportedPool>,
}

// SAFETY: a CUmemoryPool is a driver handle usable from any thread of the process; the other
// fields are Send and Sync.
unsafe impl Send for ImportedPool {}
// SAFETY: as for Send; the handle is only passed to the driver, which synchronises internally.
unsafe impl Sync for ImportedPool {}

impl Drop for ImportedPool {
    fn drop(&mut self) {
        let r = self.ctx.enter().and_then(|_cur| {
            // SAFETY: context current (`_cur`); the imported pool is destroyed once, after every
            // pointer imported from it was freed (each holds this struct).
            check("cuMemPoolDestroy", unsafe {
                sys::cuMemPoolDestroy(self.pool)
            })
            .map_err(Into::into)
        });
        match r {
            Ok(()) => cache::bump(&cache::POOL_RELEASES),
            Err(e) => tracing::warn!("{e}; an imported memory pool stays until exit"),
        }
    }
}

/// The pool a pool token names, imported into `ctx` once per (exporter, pool export id, context):
/// from the cache, or fetched and imported by one caller while the others of that key wait.
fn import_pool(ctx: &Arc<Context>, token: &Token) -> Result<Arc<ImportedPool>> {
    let key: PoolKey = (token.exporter, token.export_id, ctx.as_raw() as usize);
    let (p, how) = IMPORTED_POOLS.get_or_open(key, |lease| {
        require_peer(ctx, token.device)?;
        let fd = fetch_fd(token, -1)?;
        let _cur = ctx.enter()?;
        let mut pool = MaybeUninit::<sys::CUmemoryPool>::uninit();
        // SAFETY: context current (`_cur`); the OS handle is the descriptor's value as a
        // pointer-sized integer; the driver does not take ownership of it (`fd` closes when it
        // drops below).
        check("cuMemPoolImportFromShareableHandle", unsafe {
            sys::cuMemPoolImportFromShareableHandle(
                pool.as_mut_ptr(),
                fd.as_raw_fd() as usize as *mut std::ffi::c_void,
                POSIX_FD,
                0,
            )
        })?;
        drop(fd);
        cache::bump(&cache::POOL_IMPORTS);
        // From here the `ImportedPool` destroys the pool, also when granting access fails.
        let p = ImportedPool {
            // SAFETY: written on success.
            pool: unsafe { pool.assume_init() },
            ctx: ctx.clone(),
            _lease: lease,
        };
        if ctx.device().uuid() != token.device {
            let desc = access_desc(&ctx.device());
            // SAFETY: context current (`_cur`); live imported pool; one valid access descriptor.
            check("cuMemPoolSetAccess", unsafe {
                sys::cuMemPoolSetAccess(p.pool, &desc, 1)
            })?;
        }
        Ok(p)
    })?;
    cache::count_wait(how);
    Ok(p)
}

/// Opens (or finds in the cache) the mapping a pool token names, in `ctx`: one
/// `cuMemPoolImportPointer` per (exporter, pool, pointer, context), shared by every thread that
/// asks for it meanwhile.
pub(crate) fn open_pool(ctx: &Arc<Context>, token: &Token) -> Result<Arc<Mapping>> {
    if token.offset != 0 {
        return Err(Error::InvalidToken(format!(
            "a pool token names a whole allocation; offset {}",
            token.offset
        )));
    }
    let size = usize::try_from(token.len)
        .ok()
        .filter(|&s| s > 0)
        .ok_or_else(|| Error::InvalidToken(format!("pool allocation size {}", token.len)))?;
    let is_self = token.exporter == ProcessIdentity::current()?;
    let key = MappingKey::of(token, ctx);
    let (m, how) = cache::MAPPINGS.get_or_open(key, |lease| {
        let (origin, base) = if is_self {
            match lock(&LOCAL_POOL).get(&token.handle).map(Weak::upgrade) {
                Some(Some(a)) => {
                    cache::count_self_import();
                    let base = a.ptr;
                    (Origin::local(Box::new(a)), base)
                }
                _ => {
                    return Err(Error::InvalidArgument(
                        "the token names a pool buffer this process exported and has since freed"
                            .into(),
                    ));
                }
            }
        } else {
            let pool = import_pool(ctx, token)?;
            let mut data = sys::CUmemPoolPtrExportData {
                reserved: token.handle,
            };
            let _cur = ctx.enter()?;
            let mut ptr = MaybeUninit::<sys::CUdeviceptr>::uninit();
            // SAFETY: context current (`_cur`); live imported pool; `data` holds the 64 export
            // bytes; `ptr` a valid out-pointer. Garbage export data is refused by the driver.
            check("cuMemPoolImportPointer", unsafe {
                sys::cuMemPoolImportPointer(ptr.as_mut_ptr(), pool.pool, &mut data)
            })?;
            cache::count_open();
            // SAFETY: written on success.
            (Origin::pool_pointer(Box::new(pool)), unsafe {
                ptr.assume_init()
            })
        };
        Ok(Mapping {
            base,
            size,
            origin,
            ctx: ctx.clone(),
            _lease: Some(lease),
        })
    })?;
    cache::count_served(how);
    Ok(m)
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
