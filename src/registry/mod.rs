//! The registry: a named POSIX shared-memory segment of fixed-layout slots carrying published handles,
//! sequence numbers and the liveness of every participant. It stores handles as bytes and never calls
//! CUDA.

mod error;

pub use error::RegistryError;
