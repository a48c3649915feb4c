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
//! | `IMPORTED_POOLS` (in `pool.rs`) | exporter, pool's fd export id, context | the imported pool | fd fetch + `cuMemPoolImportFromShareableHandle` / `cuMemPoolDestroy` |
//! | `EVENTS` (in `event.rs`) | handle bytes, context | the opened event | `cuIpcOpenEventHandle` / `cuEventDestroy_v2` |
//!
//! The export tables map handle bytes of this process's own exports to their allocations, so an
//! import of one's own handle returns the local allocation (the driver refuses it): the legacy
//! one is here, the VMM and pool ones beside their kinds in `vmm.rs` and `pool.rs`.
//!
//! This module names no memory kind: a [`Mapping`] holds its memory as an opaque keep-alive
//! ([`Origin`]), so `vmm.rs`, `pool.rs` and `memory.rs` build on the cache and the cache imports
//! none of them.

use super::flight::{Lease, SingleFlight};
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
    OPENS_HERE.with(|c| c.set(c.get() + 1));
}

thread_local! {
    /// Memory imports this thread made with the driver (as `driver_opens`), so that one call can
    /// say how many it made ([`opens_on_this_thread`]): the process-wide counters mix threads.
    static OPENS_HERE: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// The steps of an import, timed apart per thread ([`add_import_time`]).
#[derive(Clone, Copy, Debug)]
pub(crate) enum ImportStep {
    /// Fetching file descriptors from exporters (VMM and pool imports: one socket round trip per
    /// exporter, with its peer checks).
    FdFetch,
    /// `cuMemImportFromShareableHandle`.
    Import,
    /// `cuMemAddressReserve`.
    Reserve,
    /// `cuMemMap`.
    Map,
    /// `cuMemSetAccess`.
    SetAccess,
    /// The `close` of the imported descriptor.
    CloseFd,
    /// This process's identity ([`crate::identity::ProcessIdentity::current`]), asked only where
    /// a token's exporter has this process's pid (made on its first call: `/proc` read, the
    /// liveness file created and locked).
    Identity,
}

/// How many [`ImportStep`]s there are.
pub(crate) const IMPORT_STEPS: usize = ImportStep::Identity as usize + 1;

thread_local! {
    /// Time the calling thread spent in each [`ImportStep`] ([`import_times_on_this_thread`]).
    static IMPORT_TIME_HERE: std::cell::Cell<[std::time::Duration; IMPORT_STEPS]> =
        const { std::cell::Cell::new([std::time::Duration::ZERO; IMPORT_STEPS]) };
}

/// Adds `d` to the calling thread's time in `call`.
pub(crate) fn add_import_time(call: ImportStep, d: std::time::Duration) {
    IMPORT_TIME_HERE.with(|c| {
        let mut t = c.get();
        t[call as usize] = t[call as usize].saturating_add(d);
        c.set(t);
    });
}

/// Adds the time since `since` to `call` ([`add_import_time`]); returns now, for the next lap.
pub(crate) fn lap(call: ImportStep, since: std::time::Instant) -> std::time::Instant {
    let now = std::time::Instant::now();
    add_import_time(call, now.saturating_duration_since(since));
    now
}

/// Wall-clock time the calling thread spent so far in each [`ImportStep`], indexed by it: the
/// difference around one call is what that call's imports (and fd fetches) took.
pub(crate) fn import_times_on_this_thread() -> [std::time::Duration; IMPORT_STEPS] {
    IMPORT_TIME_HERE.with(std::cell::Cell::get)
}

/// Memory imports made with the driver on the calling thread so far: the difference around one
/// import is what that import made (an open runs on the thread that asked for it; one that
/// waited for another thread's open of the same key made none).
pub(crate) fn opens_on_this_thread() -> u64 {
    OPENS_HERE.with(std::cell::Cell::get)
}

/// How an importer may touch imported memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum Access {
    /// Loads and stores (`CU_MEM_ACCESS_FLAGS_PROT_READWRITE`); every import before this choice.
    #[default]
    ReadWrite,
    /// Loads only where the memory kind allows it: a VMM import is mapped with
    /// `CU_MEM_ACCESS_FLAGS_PROT_READ` (`cuMemSetAccess`), so a kernel of the importer that stores
    /// into it faults in the importer's context alone. Pool and legacy imports, and imports of
    /// this process's own exports, stay read-write (the import says so:
    /// [`super::Imported::read_only`]).
    ReadOnly,
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
    /// The access asked for: a read-only and a read-write import of one allocation are two
    /// mappings.
    pub(crate) access: Access,
}

impl MappingKey {
    /// The key of `token`'s mapping in `ctx` (`token` is a memory token).
    pub(crate) fn of(token: &Token, ctx: &Context, access: Access) -> MappingKey {
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
            access,
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
    /// Whether the device may only load from it (a VMM import mapped `PROT_READ`).
    pub(crate) read_only: bool,
    pub(crate) origin: Origin,
    // Drop order: the mapping is closed (in Drop, or by `origin` for VMM), then `ctx` is released,
    // then the lease frees the cache key, so the next import of the key opens only after this
    // close. `None` for imports kept out of the cache.
    pub(crate) ctx: Arc<Context>,
    pub(crate) _lease: Option<Lease<MappingKey, Mapping>>,
}

/// What a mapping's last drop must do, and what it keeps alive until then.
///
/// The cache knows the memory kinds only by what closing them takes; the memory itself (the local
/// allocation, the VMM map that unmaps and releases itself, the imported pool a pointer came from)
/// is an opaque keep-alive owned by the mapping and dropped after its close, so this module names
/// no type of the modules that build mappings.
pub(crate) struct Origin {
    close: Close,
    // Dropped after `Mapping::drop` ran the close: a pool pointer is freed before its imported
    // pool is released, a VMM map is unmapped when it drops.
    _keep: Option<KeepAlive>,
}

/// Whatever a mapping must keep alive (an `Arc` of an allocation, a VMM map, an imported pool).
pub(crate) type KeepAlive = Box<dyn std::any::Any + Send + Sync>;

/// How a mapping is closed when its last holder drops it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Close {
    /// Opened with `cuIpcOpenMemHandle_v2`; closed with `cuIpcCloseMemHandle`.
    IpcHandle,
    /// A pointer imported from another process's pool (`cuMemPoolImportPointer`); freed with
    /// `cuMemFree_v2`, before the imported pool (the keep-alive) is released.
    PoolPointer,
    /// Undone by the keep-alive's own drop (a VMM map unmaps and releases itself), after the
    /// context was synchronised.
    ByKeepAlive,
    /// This process's own memory; kept alive, never closed through IPC.
    Local,
}

impl Origin {
    /// Opened with `cuIpcOpenMemHandle_v2`.
    pub(crate) fn ipc_handle() -> Origin {
        Origin {
            close: Close::IpcHandle,
            _keep: None,
        }
    }

    /// A pointer imported from a pool, which `pool` keeps alive.
    pub(crate) fn pool_pointer(pool: KeepAlive) -> Origin {
        Origin {
            close: Close::PoolPointer,
            _keep: Some(pool),
        }
    }

    /// An import that `owner` undoes when it drops (a VMM map).
    pub(crate) fn closed_by(owner: KeepAlive) -> Origin {
        Origin {
            close: Close::ByKeepAlive,
            _keep: Some(owner),
        }
    }

    /// This process's own memory, kept alive by `alloc`.
    pub(crate) fn local(alloc: KeepAlive) -> Origin {
        Origin {
            close: Close::Local,
            _keep: Some(alloc),
        }
    }

    /// Whether the mapping is this process's own memory.
    pub(crate) fn is_local(&self) -> bool {
        self.close == Close::Local
    }
}

impl std::fmt::Debug for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Origin")
            .field("close", &self.close)
            .finish()
    }
}

/// Mappings opened by this process (legacy, VMM and pool pointers).
pub(crate) static MAPPINGS: SingleFlight<MappingKey, Mapping> = SingleFlight::new();

/// Exports of this process: handle bytes → allocation.
pub(crate) static LOCAL_MEM: Mutex<BTreeMap<[u8; 64], Weak<Allocation>>> =
    Mutex::new(BTreeMap::new());

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
            match self.origin.close {
                // SAFETY: `base` came from cuIpcOpenMemHandle_v2 in this context and is closed
                // exactly once, by the last holder.
                Close::IpcHandle => check("cuIpcCloseMemHandle", unsafe {
                    sys::cuIpcCloseMemHandle(self.base)
                })?,
                Close::PoolPointer => {
                    // SAFETY: `base` came from cuMemPoolImportPointer in this context and is
                    // freed exactly once, by the last holder, before its imported pool (the
                    // keep-alive) is released.
                    check("cuMemFree_v2", unsafe { sys::cuMemFree_v2(self.base) })?
                }
                // The VMM map unmaps and releases itself when the keep-alive drops.
                Close::ByKeepAlive | Close::Local => {}
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
