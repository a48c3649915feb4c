//! The registry: a named POSIX shared-memory segment of fixed-layout slots carrying published handles,
//! sequence numbers and the liveness of every participant. It stores handles as bytes and never calls
//! CUDA.

/// Errors of the registry and of the shared-memory segments under it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RegistryError {
    /// Placeholder until the registry lands.
    #[error("registry not implemented")]
    NotImplemented,
}
