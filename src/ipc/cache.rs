//! The process-wide import cache and the local export tables.
//!
//! Opening a handle costs 0.1–1.5 ms and opening it twice needs two closes, so every import goes
//! through one table keyed by (handle bytes, importing context). An entry holds a `Weak` to its
//! mapping: the last [`super::ImportedBuffer`] dropped closes the mapping once and the entry goes.
//! The export tables map handle bytes of this process's own exports to their allocations, so an
//! import of one's own handle returns the local allocation (the driver refuses it).

use crate::driver::{Allocation, Context};
use crate::ffi::{check, sys};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

/// Counters of the import cache since the process started (for tests and monitoring).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Imports served by opening a handle with the driver (`cuIpcOpenMemHandle_v2` calls).
    pub driver_opens: u64,
    /// Imports served from an existing mapping.
    pub hits: u64,
    /// Imports of this process's own exports, served by the local allocation.
    pub self_imports: u64,
    /// `cuIpcCloseMemHandle` calls (one per mapping, when its last user drops).
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

/// Key of a mapping: the handle's bytes and the importing context (as an address).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub(crate) struct MappingKey {
    pub(crate) handle: [u8; 64],
    pub(crate) ctx: usize,
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
}

pub(crate) static MAPPINGS: Mutex<BTreeMap<MappingKey, Weak<Mapping>>> =
    Mutex::new(BTreeMap::new());

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
        {
            let mut map = lock(&MAPPINGS);
            if map.get(&self.key).is_some_and(|w| w.strong_count() == 0) {
                map.remove(&self.key);
            }
        }
        if let Origin::Driver = self.origin {
            let r = self.ctx.bind().and_then(|()| {
                // Work queued in this context may still read the mapping; closing it under a
                // running kernel would fault the context, so wait for the context first. This runs
                // once per mapping (the cache keeps it open while any importer holds it).
                // SAFETY: context bound.
                check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })?;
                // SAFETY: `base` came from cuIpcOpenMemHandle_v2 in this context and is closed
                // exactly once, by the last holder.
                check("cuIpcCloseMemHandle", unsafe {
                    sys::cuIpcCloseMemHandle(self.base)
                })?;
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
}
