//! Exportable stream-ordered memory pools (`cuMemPoolCreate` with POSIX file descriptor handles)
//! and the allocations made from them.
//!
//! Owns: [`MemPool`] and [`PoolBuffer`] on the exporting side, the table of this process's
//! exportable pools (which `foreign.rs` consults to classify pool pointers: [`our_pool`]), the
//! table of its pointer exports (for self-imports), and the importer's side: the pools imported
//! from other processes (once per exporter, pool and context, in a single-flight table) and the
//! pointers imported from them (`cuMemPoolImportPointer`, through the mapping cache
//! [`super::cache`]). The fd handle type, the peer check and the fd fetch come from
//! `shareable.rs`, which it shares with VMM memory; it imports nothing of `vmm.rs`.
//!
//! Who closes a file descriptor: the exporter's copy belongs to the pool's
//! [`super::fdpass::FdExport`] (closed when the pool and every buffer allocated from it have
//! dropped); an importer's copy is closed by [`import_pool`] right after
//! `cuMemPoolImportFromShareableHandle`, on success and on failure (the driver does not take
//! ownership of it).
//!
//! Importers must drop their imports before the exporter frees a buffer, as the driver requires.
//!
//! See <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html>.

use super::cache::{self, Mapping, MappingKey, Origin, lock};
use super::fdpass::FdExport;
use super::flight::{Lease, SingleFlight};
use super::shareable::{POSIX_FD, access_desc, fetch_fd, location, require_peer};
use crate::driver::{Context, DeviceMemory, Stream};
use crate::error::{Error, Result};
use crate::ffi::{check, sys};
use crate::identity::ProcessIdentity;
use crate::token::{Token, TokenKind};
use std::collections::{BTreeMap, HashMap};
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex, Weak};

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
            tracing::warn!(
                "{e}; the allocation of {} stays in its pool",
                crate::error::bytes(self.len)
            );
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
    let is_self = token.exporter.is_current()?;
    // Pool memory is imported read-write whatever was asked (its access is the imported pool's,
    // shared by every import of it here): one mapping per pointer.
    let key = MappingKey::of(token, ctx, cache::Access::ReadWrite);
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
            read_only: false,
            origin,
            ctx: ctx.clone(),
            _lease: Some(lease),
        })
    })?;
    cache::count_served(how);
    Ok(m)
}
