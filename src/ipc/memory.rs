use super::cache::{self, Access, LOCAL_MEM, MAPPINGS, Mapping, MappingKey, Origin, Source, lock};
use super::flight::Lease;
use super::handle::{IpcMemHandle, NotImportable, to_raw_mem};
use super::shareable::FdSource;
use crate::driver::{Context, Device, DeviceBuffer, DeviceMemory};
use crate::error::{Error, Result};
use crate::ffi::{check, sys};
use crate::identity::ProcessIdentity;
use crate::token::{Token, TokenKind};
use std::collections::BTreeSet;
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::time::Instant;

impl DeviceBuffer {
    /// The `IpcMemHandle` of this allocation (`cuIpcGetMemHandle`), and registers it in this
    /// process's export table so that importing it here returns this allocation.
    ///
    /// # Errors
    /// [`Error::Unsupported`] when the platform cannot do legacy IPC (see [`crate::probe`]);
    /// [`Error::Cuda`] naming `cuIpcGetMemHandle`.
    #[doc(alias = "cuIpcGetMemHandle")]
    pub fn ipc_handle(&self) -> Result<IpcMemHandle> {
        crate::probe::require_legacy_ipc(&self.context().device())?;
        let _cur = self.context().enter()?;
        let mut h = MaybeUninit::<sys::CUipcMemHandle>::uninit();
        // SAFETY: context current (`_cur`); the pointer is the base of a live cuMemAlloc
        // allocation; `h` is a valid out-pointer.
        check("cuIpcGetMemHandle", unsafe {
            sys::cuIpcGetMemHandle(h.as_mut_ptr(), self.device_ptr())
        })?;
        // SAFETY: written on success.
        let h = unsafe { h.assume_init() };
        let handle = IpcMemHandle(h.reserved.map(|b| b as u8));
        let mut local = lock(&LOCAL_MEM);
        local.retain(|_, w| w.strong_count() > 0);
        local.insert(handle.0, Arc::downgrade(&self.alloc));
        Ok(handle)
    }

    /// A token for the whole buffer. See [`DeviceBuffer::export_range`].
    ///
    /// # Errors
    /// As [`DeviceBuffer::export_range`].
    pub fn export(&self) -> Result<Token> {
        self.export_range(0, self.len())
    }

    /// A token for bytes `offset..offset + len` of this buffer: (handle, offset from the base
    /// allocation, length), the device's UUID and this process's identity.
    ///
    /// The importer's mapping covers the whole allocation: allocate what you share apart from
    /// private data.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the range leaves the buffer; as [`DeviceBuffer::ipc_handle`].
    pub fn export_range(&self, offset: usize, len: usize) -> Result<Token> {
        crate::driver::memory_check_range(offset, len, self.len())?;
        let handle = self.ipc_handle()?;
        Ok(Token {
            kind: TokenKind::LegacyMemory,
            handle: handle.0,
            offset: offset as u64,
            len: len as u64,
            device: self.context().device().uuid(),
            exporter: ProcessIdentity::current()?,
            export_id: 0,
        })
    }
}

/// What [`ImportedBuffer::open_with_access`] gave: the buffer, whether it is read-only, and the
/// driver imports the call made.
#[derive(Debug)]
#[non_exhaustive]
pub struct Imported {
    /// The imported buffer.
    pub buffer: ImportedBuffer,
    /// Whether the device may only load from it (see [`Access::ReadOnly`]).
    pub read_only: bool,
    /// Driver imports this call made: 1 for an allocation opened now, 0 for one served by the
    /// import cache (also one another thread was opening) or this process's own memory.
    pub driver_imports: u32,
}

/// A range of device memory imported from another process (or from this one), valid in the
/// importing [`Context`]. `len` in bytes.
///
/// Importing goes through the process-wide cache: importing the same handle again (from any
/// token naming it) shares one mapping, and the mapping is closed (`cuIpcCloseMemHandle`) once,
/// when the last `ImportedBuffer` on it drops, after the context's queued work finished. Importing a
/// handle this process exported returns its own allocation.
///
/// The exporter must keep the memory allocated until every importer dropped its buffers: the driver
/// leaves a mapping's contents undefined once the exporter frees it or exits.
#[derive(Debug, Clone)]
pub struct ImportedBuffer {
    mapping: Arc<Mapping>,
    offset: u64,
    len: u64,
}

impl ImportedBuffer {
    /// Imports a memory token on the device it names (by UUID, whatever the ordinal here), in that
    /// device's primary context.
    ///
    /// # Errors
    /// [`Error::InvalidToken`] when the token is not memory; [`Error::DeviceNotFound`] when no
    /// visible device has its UUID; as [`ImportedBuffer::open_in`].
    pub fn open(token: &Token) -> Result<ImportedBuffer> {
        let ctx = Device::by_uuid(token.device)?.primary_context()?;
        Self::open_in(&ctx, token)
    }

    /// Imports a memory token into `ctx` (which may be on another device than the exporter's, with
    /// peer access; `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS` is passed).
    ///
    /// # Errors
    /// - [`Error::InvalidToken`] when the token's kind is not [`TokenKind::LegacyMemory`], or its range
    ///   lies outside the allocation the handle names;
    /// - [`Error::InvalidArgument`] when it names this process's own export and that buffer was
    ///   freed;
    /// - [`Error::NotImportable`] for a legacy token whose exporter has this process's pid in
    ///   another pid namespace (two containers' pid 1s: the driver would refuse it);
    /// - [`Error::Cuda`] naming `cuIpcOpenMemHandle_v2` for a garbage or stale handle
    ///   (`CUDA_ERROR_INVALID_VALUE`, `CUDA_ERROR_INVALID_HANDLE`...), or `CUDA_ERROR_TOO_MANY_PEERS`.
    #[doc(alias = "cuIpcOpenMemHandle")]
    pub fn open_in(ctx: &Arc<Context>, token: &Token) -> Result<ImportedBuffer> {
        Self::open_access(ctx, token, Access::ReadWrite, None)
    }

    /// Opens the memory `token` names in `ctx` with `access`, as [`ImportedBuffer::open_in`]
    /// (through the import cache, whose key includes the access), and says what the import
    /// gave: whether the mapping is read-only and how many driver imports this call made
    /// (`cuMemImportFromShareableHandle`, `cuMemPoolImportPointer` or `cuIpcOpenMemHandle_v2`;
    /// 0 when the mapping was in the cache or another thread opened it). [`Access::ReadOnly`]
    /// maps a VMM allocation with `CU_MEM_ACCESS_FLAGS_PROT_READ` (`cuMemSetAccess`): a store
    /// into it faults this process's context only. Pool memory (its access is set per imported
    /// pool, shared by every import of that pool here) and legacy memory (`cuIpcOpenMemHandle`
    /// has no access flags) stay read-write, as does an import of this process's own export:
    /// [`Imported::read_only`] is then `false`.
    ///
    /// # Errors
    /// As [`ImportedBuffer::open_in`]; [`Error::Cuda`] naming `cuMemSetAccess` when the driver
    /// refuses read-only access.
    #[doc(alias = "cuMemSetAccess")]
    pub fn open_with_access(ctx: &Arc<Context>, token: &Token, access: Access) -> Result<Imported> {
        Self::open_counted(ctx, token, access, None)
    }

    /// [`ImportedBuffer::open_with_access`] with the allocation's fd when the caller fetched it
    /// (used only for a VMM token whose mapping this call opens; closed right after).
    fn open_counted(
        ctx: &Arc<Context>,
        token: &Token,
        access: Access,
        fetched: Option<OwnedFd>,
    ) -> Result<Imported> {
        let before = cache::opens_on_this_thread();
        let buffer = Self::open_access(ctx, token, access, fetched)?;
        let driver_imports = cache::opens_on_this_thread().saturating_sub(before);
        Ok(Imported {
            read_only: buffer.mapping.read_only,
            buffer,
            driver_imports: driver_imports as u32,
        })
    }

    /// Opens several memory tokens in `ctx` with `access`, as [`ImportedBuffer::open_with_access`]
    /// each, in order, but with the fds of the VMM allocations of other processes that are not
    /// in the import cache fetched first, all at once, from `source` (each allocation once, in the
    /// order of `tokens`; [`super::shareable::fetch_from_exporters`] makes it one round trip per
    /// exporter). Each is then imported through the cache as one alone is (same key, same
    /// single-flight: when another thread opened the allocation meanwhile, the fetched fd is
    /// closed unused), on this thread, so each [`Imported::driver_imports`] counts this call's.
    /// Other kinds, self-imports and cached allocations are opened as by `open_with_access`.
    ///
    /// # Errors
    /// As [`ImportedBuffer::open_with_access`]; what `source` returned (the fetch's own errors),
    /// or [`Error::InvalidArgument`] when it returned another number of fds than tokens asked.
    /// On an error no import of this call is kept (those made are dropped: back to the cache).
    pub(crate) fn open_many(
        ctx: &Arc<Context>,
        tokens: &[Token],
        access: Access,
        source: FdSource<'_>,
    ) -> Result<Vec<Imported>> {
        // This process's identity only where a token could be its own (same pid): a first open
        // of another process's set does not wait for it (`/proc` reads, the liveness file).
        let t = Instant::now();
        let me = if tokens.iter().any(|t| t.exporter.pid == std::process::id()) {
            Some(ProcessIdentity::current()?)
        } else {
            None
        };
        cache::lap(cache::ImportStep::Identity, t);
        let want = fetch_plan(tokens, me.as_ref(), |t| {
            cache::MAPPINGS.is_present(&MappingKey::of(t, ctx, access))
        });
        let mut fds: Vec<Option<OwnedFd>> = (0..tokens.len()).map(|_| None).collect();
        if !want.is_empty() {
            let asked: Vec<&Token> = want.iter().map(|&i| &tokens[i]).collect();
            let started = Instant::now();
            let got = source(&asked);
            cache::add_import_time(cache::ImportStep::FdFetch, started.elapsed());
            let got = got?;
            if got.len() != want.len() {
                return Err(Error::InvalidArgument(format!(
                    "the fd source returned {} fds for {} allocations",
                    got.len(),
                    want.len()
                )));
            }
            for (i, fd) in want.into_iter().zip(got) {
                cache::bump(&cache::FD_FETCHES);
                fds[i] = Some(fd);
            }
        }
        tokens
            .iter()
            .zip(fds)
            .map(|(t, fd)| Self::open_counted(ctx, t, access, fd))
            .collect()
    }

    /// Whether this process's device may only load from the buffer (a VMM import mapped
    /// read-only, [`ImportedBuffer::open_with_access`]).
    pub fn is_read_only(&self) -> bool {
        self.mapping.read_only
    }

    fn open_access(
        ctx: &Arc<Context>,
        token: &Token,
        access: Access,
        fetched: Option<OwnedFd>,
    ) -> Result<ImportedBuffer> {
        let mapping = match token.kind {
            TokenKind::LegacyMemory => {
                let own = NotImportable::own_or_openable(&token.exporter, "cuIpcOpenMemHandle_v2")?;
                open_mapping(ctx, &IpcMemHandle(token.handle), own)?
            }
            TokenKind::VmmMemory => super::vmm::open_vmm(ctx, token, access, fetched)?,
            TokenKind::PoolMemory => super::pool::open_pool(ctx, token)?,
            other => {
                return Err(Error::InvalidToken(format!(
                    "expected a memory token, got {other:?}"
                )));
            }
        };
        let in_range = token
            .offset
            .checked_add(token.len)
            .is_some_and(|end| end <= mapping.size as u64);
        if !in_range {
            return Err(Error::InvalidToken(format!(
                "range {}+{} lies outside the {}-byte allocation the handle names",
                token.offset, token.len, mapping.size
            )));
        }
        Ok(ImportedBuffer {
            mapping,
            offset: token.offset,
            len: token.len,
        })
    }

    /// Whether this import is served by this process's own allocation (a self-import).
    pub fn is_local(&self) -> bool {
        self.mapping.origin.is_local()
    }

    pub(crate) fn from_mapping(mapping: Arc<Mapping>, offset: u64, len: u64) -> ImportedBuffer {
        ImportedBuffer {
            mapping,
            offset,
            len,
        }
    }

    /// Base address of the whole mapped allocation (the range starts `offset` bytes later).
    pub fn allocation_base(&self) -> u64 {
        self.mapping.base
    }

    /// Bytes of the whole mapped allocation (from [`ImportedBuffer::allocation_base`]).
    pub(crate) fn allocation_size(&self) -> usize {
        self.mapping.size
    }

    /// Imports a VMM allocation from a file descriptor you received through your own transport
    /// (from [`super::VmmBuffer::export_fd`] in another process), mapping `size` bytes (the
    /// exporter's [`super::VmmBuffer::allocation_size`]) in `ctx`. The descriptor stays yours:
    /// close it when you like; the import holds its own reference to the memory. Not cached.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for `size == 0`; [`Error::Cuda`] naming
    /// `cuMemImportFromShareableHandle` for a descriptor that is not a CUDA allocation, or `cuMemMap`
    /// when `size` exceeds the allocation. Nothing is leaked on failure.
    #[doc(alias = "cuMemImportFromShareableHandle")]
    pub fn from_vmm_fd(
        ctx: &Arc<Context>,
        fd: BorrowedFd<'_>,
        size: usize,
    ) -> Result<ImportedBuffer> {
        if size == 0 {
            return Err(Error::InvalidArgument(
                "a VMM import needs at least 1 byte".into(),
            ));
        }
        let m = Arc::new(super::vmm::uncached_vmm_mapping(
            ctx,
            fd,
            size,
            Access::ReadWrite,
        )?);
        Ok(ImportedBuffer::from_mapping(m, 0, size as u64))
    }
}

/// Which of `tokens` a batched import fetches fds for ([`ImportedBuffer::open_many`]): VMM tokens
/// of processes other than `me` (`None`: no token is this process's) whose mapping `cached` says is not there, each allocation
/// (exporter, export id, handle) once, at its first position. Returns those positions, rising.
fn fetch_plan(
    tokens: &[Token],
    me: Option<&ProcessIdentity>,
    cached: impl Fn(&Token) -> bool,
) -> Vec<usize> {
    let mut seen = BTreeSet::new();
    tokens
        .iter()
        .enumerate()
        .filter(|(_, t)| t.kind == TokenKind::VmmMemory && Some(&t.exporter) != me)
        .filter(|(_, t)| seen.insert((t.exporter, t.export_id, t.handle)))
        .filter(|(_, t)| !cached(t))
        .map(|(i, _)| i)
        .collect()
}

impl IpcMemHandle {
    /// Imports the whole allocation this handle names into `ctx`, through the cache (see
    /// [`ImportedBuffer`]). A handle exported by this process returns the local allocation.
    ///
    /// # Errors
    /// As [`ImportedBuffer::open_in`].
    #[doc(alias = "cuIpcOpenMemHandle")]
    pub fn open(&self, ctx: &Arc<Context>) -> Result<ImportedBuffer> {
        let mapping = open_mapping(ctx, self, true)?;
        let len = mapping.size as u64;
        Ok(ImportedBuffer {
            mapping,
            offset: 0,
            len,
        })
    }
}

/// The mapping of a legacy handle in `ctx`, from the cache or opened once (see [`super::flight`]):
/// the local allocation when `maybe_self` and the handle is one of this process's exports, else
/// `cuIpcOpenMemHandle_v2`.
fn open_mapping(
    ctx: &Arc<Context>,
    handle: &IpcMemHandle,
    maybe_self: bool,
) -> Result<Arc<Mapping>> {
    let key = MappingKey {
        source: Source::Legacy,
        handle: handle.0,
        ctx: ctx.as_raw() as usize,
        access: Access::ReadWrite,
    };
    let (m, how) = MAPPINGS.get_or_open(key, |lease| {
        let local = if maybe_self {
            lock(&LOCAL_MEM).get(&handle.0).map(|w| w.upgrade())
        } else {
            None
        };
        match local {
            Some(Some(alloc)) => {
                cache::count_self_import();
                Ok(Mapping {
                    base: alloc.ptr,
                    size: alloc.len,
                    read_only: false,
                    ctx: ctx.clone(),
                    origin: Origin::local(Box::new(alloc)),
                    _lease: Some(lease),
                })
            }
            Some(None) => Err(Error::InvalidArgument(
                "the handle names a buffer this process exported and has since freed".into(),
            )),
            None => open_driver_mapping(ctx, handle, lease),
        }
    })?;
    cache::count_served(how);
    Ok(m)
}

/// `cuIpcOpenMemHandle_v2` of `handle` in `ctx`, and the size of what it mapped.
fn open_driver_mapping(
    ctx: &Arc<Context>,
    handle: &IpcMemHandle,
    lease: Lease<MappingKey, Mapping>,
) -> Result<Mapping> {
    // Current until the size query below is done; `m` (declared later) drops first on failure.
    let _cur = ctx.enter()?;
    let mut base = MaybeUninit::<sys::CUdeviceptr>::uninit();
    // SAFETY: context current (`_cur`); `base` a valid out-pointer; the handle is passed by value
    // and the driver validates it (garbage bytes give an error code, checked below).
    check("cuIpcOpenMemHandle_v2", unsafe {
        sys::cuIpcOpenMemHandle_v2(
            base.as_mut_ptr(),
            to_raw_mem(handle),
            sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
        )
    })?;
    cache::count_open();
    // SAFETY: written on success.
    let base = unsafe { base.assume_init() };
    // From here the `Mapping` closes what was opened, also when the size query fails.
    let mut m = Mapping {
        base,
        size: 0,
        read_only: false,
        ctx: ctx.clone(),
        origin: Origin::ipc_handle(),
        _lease: Some(lease),
    };
    m.size = allocation_size(base)?;
    Ok(m)
}

/// Size in bytes of the allocation starting at `base` (`cuMemGetAddressRange_v2`); the caller holds
/// the context of the mapping current ([`Context::enter`]).
fn allocation_size(base: u64) -> Result<usize> {
    let mut start = MaybeUninit::<sys::CUdeviceptr>::uninit();
    let mut size = MaybeUninit::<usize>::uninit();
    // SAFETY: the mapping's context is current (the caller's guard); `base` is a mapped address;
    // both out-pointers valid.
    check("cuMemGetAddressRange_v2", unsafe {
        sys::cuMemGetAddressRange_v2(start.as_mut_ptr(), size.as_mut_ptr(), base)
    })?;
    // SAFETY: written on success.
    Ok(unsafe { size.assume_init() })
}

impl DeviceMemory for ImportedBuffer {
    fn device_ptr(&self) -> u64 {
        self.mapping.base + self.offset
    }
    fn len(&self) -> usize {
        self.len as usize
    }
    fn context(&self) -> &Arc<Context> {
        &self.mapping.ctx
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::Uuid;

    fn who(pid: u32) -> ProcessIdentity {
        ProcessIdentity {
            pid,
            start_time: 1000 + u64::from(pid),
            boot_id: [7; 16],
            pid_ns: 1,
        }
    }

    fn token(kind: TokenKind, exporter: u32, export_id: u32) -> Token {
        let mut handle = [0u8; 64];
        handle[..4].copy_from_slice(&(export_id as i32 + 100).to_le_bytes());
        Token {
            kind,
            handle,
            offset: 0,
            len: 4096,
            device: Uuid([0; 16]),
            exporter: who(exporter),
            export_id,
        }
    }

    #[test]
    fn a_batch_fetches_each_uncached_foreign_vmm_allocation_once_in_order() {
        let me = who(1);
        let tokens = [
            token(TokenKind::VmmMemory, 2, 5),    // 0: fetched
            token(TokenKind::LegacyMemory, 2, 0), // 1: legacy: no fd
            token(TokenKind::VmmMemory, 1, 6),    // 2: this process's own: no fd
            token(TokenKind::VmmMemory, 3, 5),    // 3: same id, other exporter: fetched
            token(TokenKind::VmmMemory, 2, 5),    // 4: the allocation of 0 again: once
            token(TokenKind::VmmMemory, 2, 9),    // 5: cached: no fd
            token(TokenKind::PoolMemory, 2, 4),   // 6: pool: its own import path
            token(TokenKind::VmmMemory, 2, 7),    // 7: fetched
        ];
        let plan = fetch_plan(&tokens, Some(&me), |t| t.export_id == 9);
        assert_eq!(plan, [0, 3, 7]);
        assert!(fetch_plan(&tokens, Some(&me), |_| true).is_empty());
        assert!(fetch_plan(&[], Some(&me), |_| false).is_empty());
        // No token of this process's pid: its identity is not made, every other VMM token counts.
        assert_eq!(
            fetch_plan(&tokens, None, |t| t.export_id == 9),
            [0, 2, 3, 7]
        );
    }
}
