//! Zero-copy sharing of CUDA device buffers and events between processes, each with its own context.
#![doc = include_str!("../docs/crate-doc.md")]
// docs.rs (`--cfg docsrs`, Cargo.toml): each feature-gated item is marked with its feature.
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod channel;
pub mod cleanup;
#[cfg(feature = "cudarc")]
pub mod cudarc_interop;
pub mod driver;
pub mod error;
pub(crate) mod ffi;
pub mod identity;
pub mod ipc;
pub(crate) mod kernels;
pub mod probe;
pub mod quota;
pub mod raw;
pub mod registry;
#[cfg(feature = "remote")]
pub mod remote;
pub(crate) mod shm;
pub(crate) mod sync;
pub mod tensorset;
pub mod token;

pub use error::{CudaError, Error, OsError, Result};
pub use shm::ShmError;

/// The README's Rust code, compiled as a doctest so that it stays in step with the API.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

/// The guide's Rust code (docs/guide.md, the README's longer companion), compiled likewise.
#[cfg(doctest)]
#[doc = include_str!("../docs/guide.md")]
pub struct GuideDoctests;
