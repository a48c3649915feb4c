//! The crate's error type: the one face users match on.
//!
//! Owns: [`Error`] and [`OsError`] (a failed system call, named, with errno). Every layer returns
//! [`Result`]; each layer's own error type is one variant here, carried as it is:
//!
//! | variant | layer | its type |
//! | --- | --- | --- |
//! | [`Error::Cuda`] | `ffi` (a failed driver call) | [`CudaError`], defined there, re-exported here |
//! | [`Error::NotExportable`] | `ipc` (foreign memory) | [`crate::ipc::NotExportable`] |
//! | [`Error::Shm`] | `shm` (segments, seqlock) | [`crate::shm::ShmError`] |
//! | [`Error::Registry`] | `registry` (its layout, records, participants) | [`crate::registry::RegistryError`] |
//! | [`Error::FdPass`] | `ipc::fdpass` (file descriptors passed between processes) | [`crate::ipc::FdPassError`] |
//! | [`Error::Channel`] | `channel` | [`crate::channel::ChannelError`] |
//! | [`Error::Quota`] | `quota` (the budget ledger across processes) | [`crate::quota::QuotaError`] |
//! | [`Error::TensorSet`] | `tensorset` | [`crate::tensorset::TensorSetError`] |
//!
//! A lower layer's error is not wrapped again by the layers above it: a segment that does not
//! exist is `Error::Shm(ShmError::NotFound { .. })` whether a [`crate::shm::Segment`], a registry
//! or a channel opened it, so there is one pattern per failure. The other variants (timeouts,
//! invalid arguments and tokens, unsupported platforms, failed system calls) are shared by several
//! layers; what only one layer reports (a channel's producer gone or closed, an fd exporter gone)
//! is that layer's own error.
//!
//! This module sits outside the layer stack (docs/ARCHITECTURE.md, "Module graph"): every module
//! may use it, and it names the layers' error types as variant payloads only. It calls nothing of
//! theirs; besides the errors it owns how every message writes a count (`plural`, `bytes`: `1
//! byte`, `2 bytes`).

use std::time::Duration;

pub use crate::ffi::CudaError;

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
    ///
    /// `Display` names `libcuda.so.1` and `libcuda.so` and how many other names were tried (`none of
    /// libcuda.so.1, libcuda.so and 13 other names could be loaded`); `searched` keeps the whole
    /// list.
    #[error(
        "CUDA driver not found: {}; install the NVIDIA driver or add its folder to LD_LIBRARY_PATH",
        few_of(searched)
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
    /// A legacy IPC handle that the driver would refuse to open in this process, found before
    /// asking it; the inner error names the cause and the fix ([`crate::ipc::NotImportable`]).
    #[error(transparent)]
    NotImportable(#[from] crate::ipc::NotImportable),
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
    /// stable copy ([`crate::raw::shm`]); the same variant whichever layer opened the segment (a
    /// [`crate::shm::Segment`], a registry, a channel).
    #[error(transparent)]
    Shm(#[from] crate::shm::ShmError),
    /// The shared-memory registry or its protocol reported an error (its layout, records or
    /// participants; what its segment reports is [`Error::Shm`]).
    #[error(transparent)]
    Registry(#[from] crate::registry::error::RegistryError),
    /// Passing a file descriptor from another process failed: the exporter is gone, does not
    /// offer the fd, refuses this process, speaks another protocol version, or is not what listens
    /// at its socket path ([`crate::ipc::fdpass`]).
    #[error(transparent)]
    FdPass(#[from] crate::ipc::FdPassError),
    /// A channel could not be created, attached or used, or its producer died or closed it
    /// ([`crate::channel::ChannelError::ProducerGone`], [`crate::channel::ChannelError::Closed`]).
    #[error(transparent)]
    Channel(#[from] crate::channel::ChannelError),
    /// A quota ledger refused a reservation ([`crate::quota::QuotaError::OverQuota`], naming who
    /// holds how much) or could not be used (its layout, its budget's owner, a group); what its
    /// segment reports is [`Error::Shm`].
    #[error(transparent)]
    Quota(#[from] crate::quota::QuotaError),
    /// A tensor set could not be created, opened or read, or its writer died or closed it
    /// ([`crate::tensorset::TensorSetError::WriterGone`], `LayoutMismatch`, `BadManifest`, ...).
    #[error(transparent)]
    TensorSet(#[from] crate::tensorset::TensorSetError),
    /// The remote lane failed (`cuda_ipc::remote`, feature `remote`).
    #[cfg(feature = "remote")]
    #[error(transparent)]
    Remote(#[from] crate::remote::error::RemoteError),
    /// An object made before this process was forked from its maker was used in the forked child
    /// (a channel's producer or consumer, a tensor set's writer, reader or hold, a registry, ...).
    /// The object stands for what the parent holds (a consumer slot, a hold, a segment's name, a
    /// CUDA context, which does not survive `fork`): the child makes its own (opens the channel or
    /// set again). Its `Drop` in the child does nothing shared ([`crate::identity::ForkEpoch`]).
    #[error(
        "this {what} was made before this process was forked: a forked child cannot use its \
         parent's {what}; open or create its own in the child"
    )]
    ForkedChild {
        /// What was used (`"channel consumer"`, `"tensor set reader"`).
        what: &'static str,
    },
    /// A bounded wait ran out.
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout {
        /// What was awaited.
        what: &'static str,
        /// How long was waited.
        after: Duration,
    },
}

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

/// `n` followed by `unit`, in the plural unless `n` is 1: `1 byte`, `0 bytes`, `4096 bytes`. How
/// the crate's messages write a count, whatever integer type (or reference to one) holds it; the
/// Python extension's and the command line's messages write theirs with it too.
pub fn plural(n: impl std::fmt::Display, unit: &str) -> String {
    let n = n.to_string();
    let s = if n == "1" { "" } else { "s" };
    format!("{n} {unit}{s}")
}

/// `n` bytes as the crate's messages write them: [`plural`]`(n, "byte")` (`1 byte`, `2 bytes`).
pub fn bytes(n: impl std::fmt::Display) -> String {
    plural(n, "byte")
}

/// The driver library names of the comma-separated list `names` as a message shows them: the two
/// a Linux driver installs first (`libcuda.so.1`, `libcuda.so`, where the list has them), then how
/// many others were tried (`none of libcuda.so.1, libcuda.so and 13 other names could be
/// loaded`).
fn few_of(names: &str) -> String {
    let mut all: Vec<&str> = names.split(", ").filter(|n| !n.is_empty()).collect();
    // Stable: the rest keep the order they were tried in.
    all.sort_by_key(|n| match *n {
        "libcuda.so.1" => 0,
        "libcuda.so" => 1,
        _ => 2,
    });
    match all.len() {
        0 => "no library name was tried".to_string(),
        1 => format!("{} could not be loaded", all[0]),
        2 => format!("neither {} nor {} could be loaded", all[0], all[1]),
        n => format!(
            "none of {}, {} and {} could be loaded",
            all[0],
            all[1],
            plural(n - 2, "other name")
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_driver_names_the_linux_library_first_and_counts_the_rest() {
        let e = Error::DriverNotFound {
            searched: "libcuda.so, libcuda64.so, libcuda64_12.so, libcuda.so.1".into(),
        };
        assert_eq!(
            e.to_string(),
            "CUDA driver not found: none of libcuda.so.1, libcuda.so and 2 other names could be \
             loaded; install the NVIDIA driver or add its folder to LD_LIBRARY_PATH"
        );
        assert_eq!(few_of("libcuda.so"), "libcuda.so could not be loaded");
        assert_eq!(few_of("a, b"), "neither a nor b could be loaded");
        assert_eq!(
            few_of("a, b, c"),
            "none of a, b and 1 other name could be loaded"
        );
        assert_eq!(few_of(""), "no library name was tried");
    }

    #[test]
    fn a_count_of_one_is_singular_and_every_other_plural() {
        assert_eq!(bytes(1u64), "1 byte");
        // As the fields of a `thiserror` message give it: by reference.
        let len = 1usize;
        assert_eq!(bytes(&len as &dyn std::fmt::Display), "1 byte");
        for (n, text) in [
            (0, "0 bytes"),
            (2, "2 bytes"),
            (11, "11 bytes"),
            (-1, "-1 bytes"),
        ] {
            assert_eq!(bytes(n), text);
        }
        assert_eq!(plural(1, "other name"), "1 other name");
        assert_eq!(plural(21u8, "other name"), "21 other names");
    }
}
