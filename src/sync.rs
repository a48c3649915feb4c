//! The atomics every shared-memory structure uses, in one place so that `loom` can replace them.
//!
//! Under `--cfg loom` these are loom's model-checked atomics; otherwise `std`'s.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};
#[cfg(not(loom))]
#[allow(unused_imports)]
pub(crate) use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};
