//! The process-wide import caches and the local export tables.
//!
//! Opening a handle costs 0.1–1.5 ms (an fd kind adds a socket round trip to the exporter), and
//! opening it twice needs two closes, so every import goes through a table keyed by what it opens
//! and the importing context. Each table is a [`SingleFlight`]: one open per key at a time, shared
//! with every thread that asked for the same key meanwhile; other keys never wait for it; the last
//! holder's drop closes once, and the key is free again only after that close (see
//! [`super::flight`]).
//!
//! | table | key | value | open / close |
//! | --- | --- | --- | --- |
//! | [`MAPPINGS`] | [`MappingKey`] | [`Mapping`] | `cuIpcOpenMemHandle_v2` / `cuIpcCloseMemHandle`; fd fetch + `cuMemImportFromShareableHandle` + map / unmap + release; `cuMemPoolImportPointer` / `cuMemFree_v2` |
//! | [`IMPORTED_POOLS`] | [`PoolKey`] | [`ImportedPool`] | fd fetch + `cuMemPoolImportFromShareableHandle` / `cuMemPoolDestroy` |
//! | `EVENTS` (in `event.rs`) | handle bytes, context | the opened event | `cuIpcOpenEventHandle` / `cuEventDestroy_v2` |
//!
//! The export tables map handle bytes of this process's own exports to their allocations, so an
//! import of one's own handle returns the local allocation (the driver refuses it).

use super::flight::{Lease, SingleFlight};
use super::vmm::{ImportedPool, PoolAllocation, VmmAllocation, VmmMap};
use crate::driver::{Allocation, Context};
use crate::ffi::{check, sys};
use crate::identity::ProcessIdentity;
use crate::token::{Token, TokenKind};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

pub(crate) use super::flight::Served;

/// Counters of the import caches since the process started (for tests and monitoring).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Memory imports served by opening a handle with the driver (`cuIpcOpenMemHandle_v2`,
    /// `cuMemImportFromShareableHandle` or `cuMemPoolImportPointer` calls).
    pub driver_opens: u64,
    /// Memory imports served from an existing mapping (including those that waited for another
    /// thread's open of the same mapping).
    pub hits: u64,
    /// Imports (mappings, imported pools, events) that waited for another thread's open or close
    /// of the same key before being served.
    pub waits: u64,
    /// Imports of this process's own exports, served by the local allocation.
    pub self_imports: u64,
    /// Mappings closed (`cuIpcCloseMemHandle`, a VMM unmap and release, or `cuMemFree_v2` of a
    /// pool import): one per mapping, when its last user drops.
    pub driver_closes: u64,
    /// Mappings alive now.
    pub live_mappings: u64,
    /// Pools imported from other processes (`cuMemPoolImportFromShareableHandle`).
    pub pool_imports: u64,
    /// Imported pools destroyed (`cuMemPoolDestroy`), after their last pointer was freed.
    pub pool_releases: u64,
    /// IPC events opened from other processes' handles (`cuIpcOpenEventHandle`).
    pub event_opens: u64,
    /// Event imports served by an event already open in that context.
    pub event_hits: u64,
    /// Opened IPC events destroyed (`cuEventDestroy_v2`), when their last user dropped.
    pub event_closes: u64,
    /// File descriptors fetched from exporters for VMM and pool imports.
    pub fd_fetches: u64,
}

static DRIVER_OPENS: AtomicU64 = AtomicU64::new(0);
static HITS: AtomicU64 = AtomicU64::new(0);
static WAITS: AtomicU64 = AtomicU64::new(0);
static SELF_IMPORTS: AtomicU64 = AtomicU64::new(0);
static DRIVER_CLOSES: AtomicU64 = AtomicU64::new(0);
pub(crate) static POOL_IMPORTS: AtomicU64 = AtomicU64::new(0);
pub(crate) static POOL_RELEASES: AtomicU64 = AtomicU64::new(0);
pub(crate) static EVENT_OPENS: AtomicU64 = AtomicU64::new(0);
pub(crate) static EVENT_HITS: AtomicU64 = AtomicU64::new(0);
pub(crate) static EVENT_CLOSES: AtomicU64 = AtomicU64::new(0);
pub(crate) static FD_FETCHES: AtomicU64 = AtomicU64::new(0);

/// A snapshot of the import caches' counters.
pub fn cache_stats() -> CacheStats {
    // Relaxed: independent statistics counters, no data is published through them.
    let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
    CacheStats {
        driver_opens: get(&DRIVER_OPENS),
        hits: get(&HITS),
        waits: get(&WAITS),
        self_imports: get(&SELF_IMPORTS),
        driver_closes: get(&DRIVER_CLOSES),
        live_mappings: MAPPINGS.live() as u64,
        pool_imports: get(&POOL_IMPORTS),
        pool_releases: get(&POOL_RELEASES),
        event_opens: get(&EVENT_OPENS),
        event_hits: get(&EVENT_HITS),
        event_closes: get(&EVENT_CLOSES),
        fd_fetches: get(&FD_FETCHES),
    }
}

/// Adds one to a statistics counter.
pub(crate) fn bump(c: &AtomicU64) {
    // Relaxed: a statistics counter (see `cache_stats`).
    c.fetch_add(1, Ordering::Relaxed);
}

/// Counts how a memory import was served (a hit, and whether it waited).
pub(crate) fn count_served(how: Served) {
    if let Served::Hit { .. } = how {
        bump(&HITS);
    }
    count_wait(how);
}

/// Counts an import (memory or event) that waited for another thread's open or close of its key.
pub(crate) fn count_wait(how: Served) {
    if let Served::Hit { waited: true } | Served::Opened { waited: true } = how {
        bump(&WAITS);
    }
}

pub(crate) fn count_self_import() {
    bump(&SELF_IMPORTS);
}
pub(crate) fn count_open() {
    bump(&DRIVER_OPENS);
}

/// What a mapping was opened from.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub(crate) enum Source {
    /// A legacy `CUipcMemHandle`: its bytes name the allocation on this host by themselves, so the
    /// exporter is not part of the key (an [`super::IpcMemHandle`] opened without a token shares
    /// the mapping of a token naming it).
    Legacy,
    /// A VMM allocation served by `exporter` under fd export id `export_id`.
    Vmm {
        exporter: ProcessIdentity,
        export_id: u32,
    },
    /// A pointer of the pool `exporter` serves under `export_id`; the handle bytes are the
    /// pointer's export data.
    Pool {
        exporter: ProcessIdentity,
        export_id: u32,
    },
}

/// Key of a mapping: what it was opened from (the exporter's full identity, pid namespace included,
/// and the fd export id for the fd kinds: ids and fd numbers are unique only within one exporter,
/// and two containers' pid 1 may share a start time), the handle bytes, and the importing context
/// (its address: the mapping holds the context, so the address is not reused while it lives).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub(crate) struct MappingKey {
    pub(crate) source: Source,
    pub(crate) handle: [u8; 64],
    pub(crate) ctx: usize,
}

impl MappingKey {
    /// The key of `token`'s mapping in `ctx` (`token` is a memory token).
    pub(crate) fn of(token: &Token, ctx: &Context) -> MappingKey {
        let (exporter, export_id) = (token.exporter, token.export_id);
        let source = match token.kind {
            TokenKind::VmmMemory => Source::Vmm {
                exporter,
                export_id,
            },
            TokenKind::PoolMemory => Source::Pool {
                exporter,
                export_id,
            },
            _ => Source::Legacy,
        };
        MappingKey {
            source,
            handle: token.handle,
            ctx: ctx.as_raw() as usize,
        }
    }
}

/// One opened mapping of a whole exported allocation.
#[derive(Debug)]
pub(crate) struct Mapping {
    /// Base address of the mapping in `ctx`.
    pub(crate) base: u64,
    /// Size of the whole allocation in bytes.
    pub(crate) size: usize,
    pub(crate) origin: Origin,
    // Drop order: the mapping is closed (in Drop, or by `origin` for VMM), then `ctx` is released,
    // then the lease frees the cache key, so the next import of the key opens only after this
    // close. `None` for imports kept out of the cache.
    pub(crate) ctx: Arc<Context>,
    pub(crate) _lease: Option<Lease<MappingKey, Mapping>>,
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

/// Mappings opened by this process (legacy, VMM and pool pointers).
pub(crate) static MAPPINGS: SingleFlight<MappingKey, Mapping> = SingleFlight::new();

/// Exports of this process: handle bytes → allocation.
pub(crate) static LOCAL_MEM: Mutex<BTreeMap<[u8; 64], Weak<Allocation>>> =
    Mutex::new(BTreeMap::new());

/// VMM exports of this process: fd export id → allocation.
pub(crate) static LOCAL_VMM: Mutex<BTreeMap<u32, Weak<VmmAllocation>>> =
    Mutex::new(BTreeMap::new());

/// Pool exports of this process: pointer export data → allocation.
pub(crate) static LOCAL_POOL: Mutex<BTreeMap<[u8; 64], Weak<PoolAllocation>>> =
    Mutex::new(BTreeMap::new());

/// Key of an imported pool: the exporter (full identity), the pool's fd export id, and the
/// importing context's address.
pub(crate) type PoolKey = (ProcessIdentity, u32, usize);

/// Pools imported by this process.
pub(crate) static IMPORTED_POOLS: SingleFlight<PoolKey, ImportedPool> = SingleFlight::new();

/// Locks a table, recovering from poisoning: the tables hold plain data that a panic elsewhere
/// cannot leave half-updated (each update is one insert or remove).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Drop for Mapping {
    fn drop(&mut self) {
        if self.origin.is_local() {
            return;
        }
        let r = self.ctx.enter().and_then(|_cur| {
            // Work queued in this context may still read the mapping; closing it under a running
            // kernel would fault the context, so wait for the context first. This runs once per
            // mapping (the cache keeps it open while any importer holds it).
            // SAFETY: context current (`_cur`).
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
            Ok(()) => bump(&DRIVER_CLOSES),
            Err(e) => tracing::warn!(
                "{e}; the mapping of {} bytes stays until the process exits",
                self.size
            ),
        }
    }
}
