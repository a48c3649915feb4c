//! The crate's error type.
//!
//! Owns: [`Error`], [`CudaError`] (a failed driver call, named) and [`OsError`] (a failed system call,
//! named, with errno). Lower layers produce these; higher layers wrap them. Nothing here calls CUDA
//! except [`CudaError`]'s lazy lookup of the driver's name and text for a code.

use std::fmt;
use std::time::Duration;

/// Result with the crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in `cuda-ipc`.
///
/// `Display` text is lower case without a final period; the variant says which layer failed and the
/// source (if any) says how.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The CUDA driver library (`libcuda.so.1`) could not be loaded. `searched` lists the file names
    /// that were tried. Install the NVIDIA driver, or add its folder to `LD_LIBRARY_PATH`.
    #[error(
        "CUDA driver not found: none of {searched} could be loaded; install the NVIDIA driver or add its folder to LD_LIBRARY_PATH"
    )]
    DriverNotFound {
        /// The library names that were tried, comma separated.
        searched: String,
    },
    /// A CUDA driver call failed.
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// A system call failed.
    #[error(transparent)]
    Os(#[from] OsError),
    /// This machine or device cannot do what was asked (no IPC, exclusive compute mode, WSL, MIG, ...).
    /// `fix` says what to change.
    #[error("{what} is not supported here: {reason}; {fix}")]
    Unsupported {
        /// What was attempted ("CUDA IPC", "IPC events", ...).
        what: &'static str,
        /// Why it cannot work here.
        reason: String,
        /// What the user can do about it.
        fix: &'static str,
    },
    /// Memory this crate did not allocate cannot be exported: its kind (host, managed, the default
    /// stream-ordered pool, ...) or its range rules it out. Found before any IPC call; the inner
    /// error names the kind and the fix (`crate::ipc::classify`).
    #[error(transparent)]
    NotExportable(#[from] crate::ipc::NotExportable),
    /// A token's bytes could not be decoded.
    #[error("invalid token: {0}")]
    InvalidToken(String),
    /// No visible CUDA device has this UUID (devices are matched by UUID, never by ordinal).
    #[error("no visible CUDA device has UUID {0}; check CUDA_VISIBLE_DEVICES in this process")]
    DeviceNotFound(crate::driver::Uuid),
    /// An argument is out of its documented range.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A shared-memory segment could not be made, opened or trusted, or a seqlock read found no
    /// stable copy ([`crate::shm`]); the same variant whichever layer opened the segment (a
    /// [`crate::shm::Segment`], a registry, a channel).
    #[error(transparent)]
    Shm(#[from] crate::shm::ShmError),
    /// The shared-memory registry or its protocol reported an error (its layout, records or
    /// participants; what its segment reports is [`Error::Shm`]).
    #[error(transparent)]
    Registry(#[from] crate::registry::RegistryError),
    /// The channel's producer process died (found by pid + start time); no more frames will come.
    #[error("the producer (pid {pid}) is gone")]
    ProducerGone {
        /// The producer's pid.
        pid: u32,
    },
    /// The process that exported a file descriptor is gone (by pid + start time + boot id, or it is
    /// a zombie), so nothing more can be fetched from it (`crate::ipc::fdpass`). Fds fetched before
    /// stay valid.
    #[error("the exporting process (pid {pid}) is gone")]
    PeerGone {
        /// The exporter's pid.
        pid: u32,
    },
    /// A running process does not offer the file descriptor asked for (`crate::ipc::fdpass`): the
    /// export was withdrawn or never made, or the process serves no fds at all.
    #[error("process {pid} does not offer fd export {id}: {reason}")]
    FdNotOffered {
        /// The exporter's pid.
        pid: u32,
        /// The export id asked for.
        id: u32,
        /// Why, in words.
        reason: &'static str,
    },
    /// The producer closed the channel and every frame it published was delivered.
    #[error("the channel was closed by its producer")]
    ChannelClosed,
    /// A channel could not be created, attached or used.
    #[error(transparent)]
    Channel(#[from] crate::channel::ChannelError),
    /// A bounded wait ran out.
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout {
        /// What was awaited.
        what: &'static str,
        /// How long was waited.
        after: Duration,
    },
}

/// A failed CUDA driver call: the call's name and the `CUresult` it returned.
///
/// `Display` reads `cuIpcOpenMemHandle_v2 failed: CUDA_ERROR_INVALID_CONTEXT (invalid device context)`.
/// The name and text come from `cuGetErrorName` / `cuGetErrorString`; the raw number is kept for codes
/// newer than the bindings.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct CudaError {
    /// The driver entry point that failed, e.g. `"cuIpcOpenMemHandle_v2"`.
    pub call: &'static str,
    /// The raw `CUresult` value.
    pub code: u32,
}

impl CudaError {
    /// The driver's name for the code (`CUDA_ERROR_INVALID_VALUE`), from `cuGetErrorName`, or
    /// `CUDA_ERROR_<n>` when the driver does not know it.
    pub fn name(&self) -> String {
        crate::ffi::error_name(self.code).unwrap_or_else(|| format!("CUDA_ERROR_{}", self.code))
    }

    /// The driver's description of the code, from `cuGetErrorString`, or `unknown error` when none.
    pub fn description(&self) -> String {
        crate::ffi::error_string(self.code).unwrap_or_else(|| "unknown error".to_string())
    }
}

impl fmt::Display for CudaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} failed: {} ({})",
            self.call,
            self.name(),
            self.description()
        )
    }
}

impl fmt::Debug for CudaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaError")
            .field("call", &self.call)
            .field("code", &self.code)
            .field("name", &self.name())
            .finish()
    }
}

impl std::error::Error for CudaError {}

/// A failed system call: its name, what it acted on, and the OS error (errno).
///
/// `Display` reads `shm_open(/cuda-ipc.demo) failed: Permission denied (os error 13)`.
#[derive(Debug, thiserror::Error)]
#[error("{call}({target}) failed: {source}")]
pub struct OsError {
    /// The system call, e.g. `"shm_open"`.
    pub call: &'static str,
    /// What it acted on (a name, a path, a pid); may be empty.
    pub target: String,
    /// The OS error.
    #[source]
    pub source: std::io::Error,
}

impl OsError {
    /// Builds an `OsError` from a call name, its target and an errno from `rustix`.
    pub fn new(call: &'static str, target: impl Into<String>, errno: rustix::io::Errno) -> Self {
        Self {
            call,
            target: target.into(),
            source: std::io::Error::from_raw_os_error(errno.raw_os_error()),
        }
    }

    /// Builds an `OsError` from a call name, its target and a `std::io::Error`.
    pub fn io(call: &'static str, target: impl Into<String>, source: std::io::Error) -> Self {
        Self {
            call,
            target: target.into(),
            source,
        }
    }

    /// The raw errno, when there is one.
    pub fn errno(&self) -> Option<i32> {
        self.source.raw_os_error()
    }
}
