//! Zero-copy sharing of CUDA device buffers and events between processes, each with its own context.
#![doc = include_str!("../docs/crate-doc.md")]

pub mod channel;
pub mod driver;
pub mod error;
pub(crate) mod ffi;
pub mod identity;
pub mod ipc;
pub mod kernels;
pub mod probe;
pub mod registry;
pub mod shm;
pub(crate) mod sync;
pub mod token;

pub use error::{CudaError, Error, OsError, Result};
