//! The process-wide import cache and the local export tables.
//!
//! Opening a handle costs 0.1–1.5 ms and opening it twice needs two closes, so every import goes
//! through one table keyed by (handle bytes, importing context). An entry holds a `Weak` to its
//! mapping: the last [`super::ImportedBuffer`] dropped closes the mapping once and the entry goes.
//! The export tables map handle bytes of this process's own exports to their allocations, so an
//! import of one's own handle returns the local allocation (the driver refuses it).

use super::vmm::{ImportedPool, PoolAllocation, VmmAllocation, VmmMap};
use crate::driver::{Allocation, Context};
use crate::ffi::{check, sys};
use crate::token::{Token, TokenKind};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

/// Counters of the import cache since the process started (for tests and monitoring).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Imports served by opening a handle with the driver (`cuIpcOpenMemHandle_v2`,
    /// `cuMemImportFromShareableHandle` or `cuMemPoolImportPointer` calls).
    pub driver_opens: u64,
    /// Imports served from an existing mapping.
    pub hits: u64,
    /// Imports of this process's own exports, served by the local allocation.
    pub self_imports: u64,
    /// Mappings closed (`cuIpcCloseMemHandle`, a VMM unmap and release, or `cuMemFree_v2` of a
    /// pool import): one per mapping, when its last user drops.
    pub driver_closes: u64,
    /// Mappings alive now.
    pub live_mappings: u64,
}

static DRIVER_OPENS: AtomicU64 = AtomicU64::new(0);
static HITS: AtomicU64 = AtomicU64::new(0);
static SELF_IMPORTS: AtomicU64 = AtomicU64::new(0);
static DRIVER_CLOSES: AtomicU64 = AtomicU64::new(0);

/// A snapshot of the import cache's counters.
pub fn cache_stats() -> CacheStats {
    // Relaxed: independent statistics counters, no data is published through them.
    CacheStats {
        driver_opens: DRIVER_OPENS.load(Ordering::Relaxed),
        hits: HITS.load(Ordering::Relaxed),
        self_imports: SELF_IMPORTS.load(Ordering::Relaxed),
        driver_closes: DRIVER_CLOSES.load(Ordering::Relaxed),
        live_mappings: lock(&MAPPINGS)
            .values()
            .filter(|w| w.strong_count() > 0)
            .count() as u64,
    }
}

pub(crate) fn count_hit() {
    HITS.fetch_add(1, Ordering::Relaxed);
}
pub(crate) fn count_self_import() {
    SELF_IMPORTS.fetch_add(1, Ordering::Relaxed);
}
pub(crate) fn count_open() {
    DRIVER_OPENS.fetch_add(1, Ordering::Relaxed);
}

/// Key of a mapping: the handle's bytes, the exporter (pid, start time, fd export id; zero for
/// legacy handles, whose bytes are unique by themselves) and the importing context (as an address).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub(crate) struct MappingKey {
    pub(crate) handle: [u8; 64],
    pub(crate) exporter: (u32, u64, u32),
    pub(crate) ctx: usize,
}

impl MappingKey {
    /// The key of `token`'s mapping in `ctx`.
    pub(crate) fn of(token: &Token, ctx: &Context) -> MappingKey {
        let exporter = match token.kind {
            TokenKind::VmmMemory | TokenKind::PoolMemory => (
                token.exporter.pid,
                token.exporter.start_time,
                token.export_id,
            ),
            _ => (0, 0, 0),
        };
        MappingKey {
            handle: token.handle,
            exporter,
            ctx: ctx.as_raw() as usize,
        }
    }

    /// A key no other mapping has, for imports kept out of the cache.
    pub(crate) fn unique() -> MappingKey {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let mut handle = [0xff; 64];
        handle[..8].copy_from_slice(&n.to_le_bytes());
        MappingKey {
            handle,
            exporter: (u32::MAX, u64::MAX, u32::MAX),
            ctx: usize::MAX,
        }
    }
}

/// One opened mapping of a whole exported allocation.
#[derive(Debug)]
pub(crate) struct Mapping {
    pub(crate) key: MappingKey,
    /// Base address of the mapping in `ctx`.
    pub(crate) base: u64,
    /// Size of the whole allocation in bytes.
    pub(crate) size: usize,
    pub(crate) origin: Origin,
    // Drop order: the mapping is closed (in Drop) before `ctx` is released.
    pub(crate) ctx: Arc<Context>,
}

#[derive(Debug)]
pub(crate) enum Origin {
    /// Opened with `cuIpcOpenMemHandle_v2`; closed with `cuIpcCloseMemHandle`.
    Driver,
    /// This process's own allocation; kept alive, never closed through IPC.
    Local(#[allow(dead_code)] Arc<Allocation>),
    /// A VMM allocation imported from a file descriptor; the map unmaps and releases on drop.
    Vmm(#[allow(dead_code)] VmmMap),
    /// This process's own VMM allocation.
    LocalVmm(#[allow(dead_code)] Arc<VmmAllocation>),
    /// A pointer imported from another process's pool (`cuMemPoolImportPointer`); freed with
    /// `cuMemFree_v2`, before the imported pool is released.
    Pool(#[allow(dead_code)] Arc<ImportedPool>),
    /// This process's own pool allocation.
    LocalPool(#[allow(dead_code)] Arc<PoolAllocation>),
}

impl Origin {
    /// Whether the mapping is this process's own memory.
    pub(crate) fn is_local(&self) -> bool {
        matches!(
            self,
            Origin::Local(_) | Origin::LocalVmm(_) | Origin::LocalPool(_)
        )
    }
}

pub(crate) static MAPPINGS: Mutex<BTreeMap<MappingKey, Weak<Mapping>>> =
    Mutex::new(BTreeMap::new());

/// Exports of this process: handle bytes → allocation.
pub(crate) static LOCAL_MEM: Mutex<BTreeMap<[u8; 64], Weak<Allocation>>> =
    Mutex::new(BTreeMap::new());

/// VMM exports of this process: fd export id → allocation.
pub(crate) static LOCAL_VMM: Mutex<BTreeMap<u32, Weak<VmmAllocation>>> =
    Mutex::new(BTreeMap::new());

/// Pool exports of this process: pointer export data → allocation.
pub(crate) static LOCAL_POOL: Mutex<BTreeMap<[u8; 64], Weak<PoolAllocation>>> =
    Mutex::new(BTreeMap::new());

/// Key of an imported pool: (exporter pid, start time, fd export id, importing context address).
pub(crate) type PoolKey = (u32, u64, u32, usize);

/// Pools imported by this process.
pub(crate) static IMPORTED_POOLS: Mutex<BTreeMap<PoolKey, Weak<ImportedPool>>> =
    Mutex::new(BTreeMap::new());

/// Locks a table, recovering from poisoning: the tables hold plain data that a panic elsewhere
/// cannot leave half-updated (each update is one insert or remove).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Drop for Mapping {
    fn drop(&mut self) {
        {
            let mut map = lock(&MAPPINGS);
            if map.get(&self.key).is_some_and(|w| w.strong_count() == 0) {
                map.remove(&self.key);
            }
        }
        if self.origin.is_local() {
            return;
        }
        let r = self.ctx.bind().and_then(|()| {
            // Work queued in this context may still read the mapping; closing it under a running
            // kernel would fault the context, so wait for the context first. This runs once per
            // mapping (the cache keeps it open while any importer holds it).
            // SAFETY: context bound.
            check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })?;
            match self.origin {
                // SAFETY: `base` came from cuIpcOpenMemHandle_v2 in this context and is closed
                // exactly once, by the last holder.
                Origin::Driver => check("cuIpcCloseMemHandle", unsafe {
                    sys::cuIpcCloseMemHandle(self.base)
                })?,
                // SAFETY: `base` came from cuMemPoolImportPointer in this context and is freed
                // exactly once, by the last holder, before its imported pool is released.
                Origin::Pool(_) => check("cuMemFree_v2", unsafe { sys::cuMemFree_v2(self.base) })?,
                // The VMM map unmaps and releases itself when the origin drops.
                _ => {}
            }
            Ok(())
        });
        match r {
            Ok(()) => {
                DRIVER_CLOSES.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => tracing::warn!(
                "{e}; the mapping of {} bytes stays until the process exits",
                self.size
            ),
        }
    }
}
