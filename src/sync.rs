//! The atomics every shared-memory structure uses, in one place so that `loom` can replace them.
//!
//! Under `--cfg loom` these are loom's model-checked atomics; otherwise `std`'s.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};
#[cfg(not(loom))]
#[allow(unused_imports)]
pub(crate) use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};

/// Stack size of the crate's helper threads (a reader's channel join, tensor-table decoders, the
/// watchdogs), 256 KiB: they keep little on their stacks. Smaller than `std`'s 2 MiB default so
/// that no stack mapping can hold a 2 MiB-aligned extent: where transparent huge pages are on for
/// every mapping (and the kernel aligns large anonymous mappings to them), the first touch of a
/// 2 MiB stack, which `pthread_create` makes on the spawning thread when it lays out the new
/// thread's descriptor and TLS, has the kernel clear a whole huge page there first (tens of µs
/// on the opening thread of a tensor-set reader).
pub(crate) const HELPER_STACK: usize = 256 * 1024;
