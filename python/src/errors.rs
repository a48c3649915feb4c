//! The exception hierarchy: one Python class per kind of `cuda_ipc::Error`, all under
//! `CudaIpcError`, with the names the pure-Python consumer uses. Each message is the Rust error's
//! `Display` text, except for the calls of an object closed here (`close()`), a state the Rust
//! types have not (they are closed by being dropped): a producer's `ChannelClosed`, a tensor-set
//! reader's or holder's `TensorSetClosed` ([`closed_here`]). Counts in the extension's messages
//! are spelled here too ([`plural`], [`bytes`]: `1 byte`, never `1 bytes`).

use cuda_ipc::Error;
use cuda_ipc::ShmError;
use cuda_ipc::channel::ChannelError;
use cuda_ipc::identity::ForkEpoch;
use cuda_ipc::ipc::fdpass::FdPassError;
use cuda_ipc::quota::QuotaError as RustQuotaError;
use cuda_ipc::registry::RegistryError;
use cuda_ipc::tensorset::TensorSetError;
use pyo3::exceptions::{PyException, PyOSError, PyTimeoutError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

pyo3::create_exception!(
    cuda_ipc,
    CudaIpcError,
    PyException,
    "Base class of every error raised by cuda_ipc."
);
pyo3::create_exception!(
    cuda_ipc,
    ChannelNotFound,
    CudaIpcError,
    "No channel of this name exists (start its producer first)."
);
pyo3::create_exception!(
    cuda_ipc,
    ChannelExists,
    CudaIpcError,
    "A live producer already serves this channel name, or another process is creating it."
);
pyo3::create_exception!(
    cuda_ipc,
    BadSegment,
    CudaIpcError,
    "The channel's segment is foreign, of another layout version, truncated, corrupted, of another \
     owner, not fully created, or not a segment at all."
);
pyo3::create_exception!(
    cuda_ipc,
    InvalidToken,
    CudaIpcError,
    "A token's bytes could not be decoded."
);
pyo3::create_exception!(
    cuda_ipc,
    NotSupported,
    CudaIpcError,
    "This machine, device or memory cannot do what was asked; also an object used in a child made \
     by fork() that its parent made before the fork (open the child's own)."
);
pyo3::create_exception!(
    cuda_ipc,
    FdNotOffered,
    CudaIpcError,
    "The producer does not offer the file descriptor asked for."
);
pyo3::create_exception!(
    cuda_ipc,
    FdPassingError,
    CudaIpcError,
    "Fetching a VMM or memory-pool channel's file descriptors failed."
);
pyo3::create_exception!(
    cuda_ipc,
    NoConsumerSlot,
    CudaIpcError,
    "Every consumer slot of the channel is taken."
);
pyo3::create_exception!(
    cuda_ipc,
    ProducerGone,
    CudaIpcError,
    "The channel's producer (or the process exporting its memory) died."
);
pyo3::create_exception!(
    cuda_ipc,
    ChannelClosed,
    CudaIpcError,
    "The producer closed the channel and every frame it published was received."
);
pyo3::create_exception!(
    cuda_ipc,
    Detached,
    CudaIpcError,
    "This consumer's slot was taken back."
);
pyo3::create_exception!(
    cuda_ipc,
    Superseded,
    CudaIpcError,
    "The channel was removed and made again while this handle used it: attach again."
);
pyo3::create_exception!(
    cuda_ipc,
    AtomicsUnavailable,
    CudaIpcError,
    "Raised by the pure-Python consumer only (libatomic missing); kept for code that catches it."
);
pyo3::create_exception!(
    cuda_ipc,
    CudaUnavailable,
    CudaIpcError,
    "The CUDA driver could not be loaded, or no visible device fits."
);
pyo3::create_exception!(
    cuda_ipc,
    QuotaError,
    CudaIpcError,
    "A shared memory budget (a quota ledger, `quota=`) cannot serve the producer: none is set, \
     its ledger is full, it may not be changed by this user, or another user planted a file under \
     its ledger's name. `OverQuota` is its subclass for a budget that is used up."
);
pyo3::create_exception!(
    cuda_ipc,
    TensorSetNotFound,
    ChannelNotFound,
    "No tensor set of this name exists (start its writer first)."
);
pyo3::create_exception!(
    cuda_ipc,
    WriterGone,
    ProducerGone,
    "The tensor set's writer died: the generation held stays readable, no new one comes."
);
pyo3::create_exception!(
    cuda_ipc,
    TensorSetClosed,
    ChannelClosed,
    "The tensor set was closed: by its writer, or this object (a writer, reader or holder) was \
     closed by its own `close()`; the message says which."
);
pyo3::create_exception!(
    cuda_ipc,
    LayoutMismatch,
    CudaIpcError,
    "The tensor set's layout fingerprint (names, dtypes, shapes, strides, offsets) is not the one \
     expected: another checkpoint or model."
);
pyo3::create_exception!(
    cuda_ipc,
    ContentMismatch,
    CudaIpcError,
    "A generation's content fingerprint is not the one expected (``TensorSetReader(expect_content=)``), \
     or its bytes are not the ones its writer fingerprinted (``TensorHold.verify_content()``). \
     Attributes: ``generation`` (int), ``committed`` (the writer's 32 bytes; all zeros: none), \
     ``expected`` (the reader's demand, or None), ``computed`` (the bytes' fingerprint, or None)."
);
pyo3::create_exception!(
    cuda_ipc,
    NotHoldable,
    NotSupported,
    "The tensor set cannot be held by forwarding its file descriptors (`TensorSetHolder`, \
     `serve=True`): a host, pool or legacy set, one whose writer made no holders segment, or one \
     of too many allocations. Also a `NotSupported`."
);
pyo3::create_exception!(
    cuda_ipc,
    NoHolderSlot,
    CudaIpcError,
    "Every holder slot of the tensor set serves a live process (`TensorSetHolder`, `serve=True`)."
);
pyo3::create_exception!(
    cuda_ipc,
    NoServer,
    WriterGone,
    "No process could hand over the tensor set's file descriptors: its writer is dead and no live \
     holder answered; the message names each server tried and what it said. Also a `WriterGone`."
);
pyo3::create_exception!(
    cuda_ipc,
    CudaError,
    CudaIpcError,
    "A CUDA driver call failed; the message names the call and the error."
);

/// `Timeout` is also a `TimeoutError`, `InvalidArgument` a `ValueError`, `OsError` an `OSError`:
/// made by hand, since `create_exception!` takes one base.
fn subclass<'py>(
    py: Python<'py>,
    name: &str,
    doc: &str,
    second: Bound<'py, pyo3::types::PyType>,
) -> PyResult<Bound<'py, pyo3::types::PyType>> {
    subclass_of(py, name, doc, py.get_type::<CudaIpcError>(), second)
}

/// A class named `name` under `first` and `second`.
fn subclass_of<'py>(
    py: Python<'py>,
    name: &str,
    doc: &str,
    first: Bound<'py, pyo3::types::PyType>,
    second: Bound<'py, pyo3::types::PyType>,
) -> PyResult<Bound<'py, pyo3::types::PyType>> {
    let bases = pyo3::types::PyTuple::new(py, [first, second])?;
    let dict = pyo3::types::PyDict::new(py);
    dict.set_item("__doc__", doc)?;
    dict.set_item("__module__", "cuda_ipc")?;
    let ty = py
        .get_type::<pyo3::types::PyType>()
        .call1((name, bases, dict))?;
    Ok(ty.cast_into::<pyo3::types::PyType>()?)
}

/// The classes made by `subclass`, created once at import.
pub(crate) struct Extra {
    pub timeout: Py<pyo3::types::PyType>,
    pub invalid_argument: Py<pyo3::types::PyType>,
    pub os_error: Py<pyo3::types::PyType>,
    pub over_quota: Py<pyo3::types::PyType>,
}

static EXTRA: pyo3::sync::PyOnceLock<Extra> = pyo3::sync::PyOnceLock::new();

fn extra(py: Python<'_>) -> PyResult<&Extra> {
    EXTRA.get_or_try_init(py, || {
        Ok(Extra {
            timeout: subclass(
                py,
                "Timeout",
                "A bounded wait ran out.",
                py.get_type::<PyTimeoutError>(),
            )?
            .unbind(),
            invalid_argument: subclass(
                py,
                "InvalidArgument",
                "An argument is out of its documented range (a bad channel name, too much metadata, ...).",
                py.get_type::<PyValueError>(),
            )?
            .unbind(),
            os_error: subclass(
                py,
                "OsError",
                "A system call failed; the message names the call and the OS error.",
                py.get_type::<PyOSError>(),
            )?
            .unbind(),
            over_quota: subclass_of(
                py,
                "OverQuota",
                "The pool would take a memory budget past its limit: the shared one of a quota \
                 ledger (the message names each holder and its bytes), or the producer's own \
                 `quota_bytes`. Also a `ValueError`, as the latter was before.",
                py.get_type::<QuotaError>(),
                py.get_type::<PyValueError>(),
            )?
            .unbind(),
        })
    })
}

/// Adds the hierarchy to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("CudaIpcError", py.get_type::<CudaIpcError>())?;
    m.add("ChannelNotFound", py.get_type::<ChannelNotFound>())?;
    m.add("ChannelExists", py.get_type::<ChannelExists>())?;
    m.add("BadSegment", py.get_type::<BadSegment>())?;
    m.add("InvalidToken", py.get_type::<InvalidToken>())?;
    m.add("NotSupported", py.get_type::<NotSupported>())?;
    m.add("FdNotOffered", py.get_type::<FdNotOffered>())?;
    m.add("FdPassingError", py.get_type::<FdPassingError>())?;
    m.add("NoConsumerSlot", py.get_type::<NoConsumerSlot>())?;
    m.add("ProducerGone", py.get_type::<ProducerGone>())?;
    m.add("ChannelClosed", py.get_type::<ChannelClosed>())?;
    m.add("Detached", py.get_type::<Detached>())?;
    m.add("Superseded", py.get_type::<Superseded>())?;
    m.add("AtomicsUnavailable", py.get_type::<AtomicsUnavailable>())?;
    m.add("CudaUnavailable", py.get_type::<CudaUnavailable>())?;
    m.add("CudaError", py.get_type::<CudaError>())?;
    m.add("QuotaError", py.get_type::<QuotaError>())?;
    m.add("TensorSetNotFound", py.get_type::<TensorSetNotFound>())?;
    m.add("WriterGone", py.get_type::<WriterGone>())?;
    m.add("TensorSetClosed", py.get_type::<TensorSetClosed>())?;
    m.add("LayoutMismatch", py.get_type::<LayoutMismatch>())?;
    m.add("ContentMismatch", py.get_type::<ContentMismatch>())?;
    m.add("NotHoldable", py.get_type::<NotHoldable>())?;
    m.add("NoHolderSlot", py.get_type::<NoHolderSlot>())?;
    m.add("NoServer", py.get_type::<NoServer>())?;
    let x = extra(py)?;
    m.add("Timeout", x.timeout.bind(py))?;
    m.add("InvalidArgument", x.invalid_argument.bind(py))?;
    m.add("OsError", x.os_error.bind(py))?;
    m.add("OverQuota", x.over_quota.bind(py))?;
    Ok(())
}

/// Which class an error belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Base,
    ChannelNotFound,
    ChannelExists,
    BadSegment,
    InvalidToken,
    NotSupported,
    FdNotOffered,
    FdPassing,
    NoConsumerSlot,
    ProducerGone,
    ChannelClosed,
    Detached,
    Superseded,
    CudaUnavailable,
    Cuda,
    Timeout,
    InvalidArgument,
    Os,
    Quota,
    OverQuota,
    TensorSetNotFound,
    WriterGone,
    TensorSetClosed,
    LayoutMismatch,
    ContentMismatch,
    NotHoldable,
    NoHolderSlot,
    NoServer,
}

/// System calls of the fd-passing client: their failures are `FdPassingError`s.
const FD_PASSING_CALLS: &[&str] = &["socket", "connect", "sendmsg", "recvmsg", "pidfd_getfd"];

fn kind(e: &Error) -> Kind {
    match e {
        Error::DriverNotFound { .. } | Error::DeviceNotFound(_) => Kind::CudaUnavailable,
        Error::Cuda(_) => Kind::Cuda,
        Error::Os(os) if FD_PASSING_CALLS.contains(&os.call) => Kind::FdPassing,
        Error::Os(_) => Kind::Os,
        Error::Unsupported { .. } | Error::NotExportable(_) | Error::NotImportable(_) => {
            Kind::NotSupported
        }
        Error::InvalidToken(_) => Kind::InvalidToken,
        Error::InvalidArgument(_) => Kind::InvalidArgument,
        Error::Shm(s) => shm_kind(s),
        Error::Registry(r) => registry_kind(r),
        Error::FdPass(f) => match f {
            FdPassError::PeerGone { .. } => Kind::ProducerGone,
            FdPassError::NotOffered { .. } => Kind::FdNotOffered,
            // Refusals, another protocol version, something else at the socket path: what
            // `Error::Unsupported` said of them before fd passing had its own error.
            _ => Kind::NotSupported,
        },
        Error::Channel(c) => match c {
            ChannelError::ProducerGone { .. } => Kind::ProducerGone,
            ChannelError::Closed => Kind::ChannelClosed,
            ChannelError::NotFound(_) => Kind::ChannelNotFound,
            ChannelError::AlreadyExists { .. } | ChannelError::CreationInProgress(_) => {
                Kind::ChannelExists
            }
            ChannelError::NoConsumerSlot(_) => Kind::NoConsumerSlot,
            ChannelError::BadSegment(_) | ChannelError::VersionMismatch { .. } => Kind::BadSegment,
            ChannelError::Detached => Kind::Detached,
            ChannelError::Superseded(_) => Kind::Superseded,
            ChannelError::PoolOverCap { .. } => Kind::OverQuota,
            _ => Kind::Base,
        },
        Error::Timeout { .. } => Kind::Timeout,
        Error::ForkedChild { .. } => Kind::NotSupported,
        Error::TensorSet(t) => match t {
            TensorSetError::NotFound(_) => Kind::TensorSetNotFound,
            TensorSetError::AlreadyExists { .. } | TensorSetError::CreationInProgress(_) => {
                Kind::ChannelExists
            }
            TensorSetError::LayoutMismatch { .. } => Kind::LayoutMismatch,
            TensorSetError::ContentMismatch { .. } | TensorSetError::ContentUnverified { .. } => {
                Kind::ContentMismatch
            }
            TensorSetError::BadManifest { .. } | TensorSetError::VersionMismatch { .. } => {
                Kind::BadSegment
            }
            TensorSetError::WriterGone { .. } => Kind::WriterGone,
            TensorSetError::Closed(_) => Kind::TensorSetClosed,
            TensorSetError::TooManyTensors { .. }
            | TensorSetError::BadTensor { .. }
            | TensorSetError::NoSuchTensor(_) => Kind::InvalidArgument,
            TensorSetError::WrongKind(_) => Kind::NotSupported,
            TensorSetError::TooManyReaders { .. } => Kind::NoConsumerSlot,
            TensorSetError::NotHoldable { .. } => Kind::NotHoldable,
            TensorSetError::NoHolderSlot { .. } => Kind::NoHolderSlot,
            TensorSetError::NoServer { .. } => Kind::NoServer,
            _ => Kind::Base,
        },
        Error::Quota(q) => match q {
            RustQuotaError::OverQuota { .. } => Kind::OverQuota,
            RustQuotaError::BadSegment { .. } | RustQuotaError::VersionMismatch { .. } => {
                Kind::BadSegment
            }
            RustQuotaError::BadGroup { .. } => Kind::InvalidArgument,
            _ => Kind::Quota,
        },
        _ => Kind::Base,
    }
}

fn shm_kind(s: &ShmError) -> Kind {
    match s {
        ShmError::NotFound { .. } => Kind::ChannelNotFound,
        ShmError::AlreadyExists { .. } => Kind::ChannelExists,
        ShmError::InvalidName { .. } => Kind::InvalidArgument,
        ShmError::TooSmall { .. }
        | ShmError::WrongOwner { .. }
        | ShmError::InsecureMode { .. }
        | ShmError::NotASegment { .. }
        | ShmError::Sparse { .. } => Kind::BadSegment,
        ShmError::NoSpace { .. } => Kind::Os,
        _ => Kind::Base,
    }
}

fn registry_kind(r: &RegistryError) -> Kind {
    match r {
        RegistryError::InvalidName { .. } | RegistryError::TooLarge { .. } => Kind::InvalidArgument,
        RegistryError::ForeignSegment { .. }
        | RegistryError::VersionMismatch { .. }
        | RegistryError::Corrupt { .. }
        | RegistryError::Uninitialised { .. }
        | RegistryError::CreatorUnknown { .. } => Kind::BadSegment,
        RegistryError::Superseded { .. } => Kind::Superseded,
        _ => Kind::Base,
    }
}

/// `Detached`: what a consumer's calls raise once it was closed.
pub(crate) fn detached(py: Python<'_>) -> PyErr {
    to_py(py, &ChannelError::Detached.into())
}

/// The Python exception for `e`, its message the Rust `Display` text.
pub(crate) fn to_py(py: Python<'_>, e: &Error) -> PyErr {
    let msg = e.to_string();
    let k = kind(e);
    let extra_class = |pick: fn(&Extra) -> &Py<pyo3::types::PyType>| match extra(py) {
        Ok(x) => PyErr::from_type(pick(x).bind(py).clone(), msg.clone()),
        Err(err) => err,
    };
    match k {
        Kind::Base => CudaIpcError::new_err(msg),
        Kind::ChannelNotFound => ChannelNotFound::new_err(msg),
        Kind::ChannelExists => ChannelExists::new_err(msg),
        Kind::BadSegment => BadSegment::new_err(msg),
        Kind::InvalidToken => InvalidToken::new_err(msg),
        Kind::NotSupported => NotSupported::new_err(msg),
        Kind::FdNotOffered => FdNotOffered::new_err(msg),
        Kind::FdPassing => FdPassingError::new_err(msg),
        Kind::NoConsumerSlot => NoConsumerSlot::new_err(msg),
        Kind::ProducerGone => ProducerGone::new_err(msg),
        Kind::ChannelClosed => ChannelClosed::new_err(msg),
        Kind::Detached => Detached::new_err(msg),
        Kind::Superseded => Superseded::new_err(msg),
        Kind::CudaUnavailable => CudaUnavailable::new_err(msg),
        Kind::Cuda => CudaError::new_err(msg),
        Kind::Timeout => extra_class(|x| &x.timeout),
        Kind::InvalidArgument => extra_class(|x| &x.invalid_argument),
        Kind::Os => extra_class(|x| &x.os_error),
        Kind::Quota => QuotaError::new_err(msg),
        Kind::OverQuota => extra_class(|x| &x.over_quota),
        Kind::TensorSetNotFound => TensorSetNotFound::new_err(msg),
        Kind::WriterGone => WriterGone::new_err(msg),
        Kind::TensorSetClosed => TensorSetClosed::new_err(msg),
        Kind::LayoutMismatch => LayoutMismatch::new_err(msg),
        // The crate's text names the Rust method; Python commits with `fingerprint=True`.
        Kind::ContentMismatch => content_mismatch(
            py,
            e,
            msg.replace(
                "commits with commit_fingerprinted",
                "commits with TensorUpdate.commit(fingerprint=True) or \
                 TensorSetWriter.publish(..., fingerprint=True)",
            ),
        ),
        Kind::NotHoldable => NotHoldable::new_err(msg),
        Kind::NoHolderSlot => NoHolderSlot::new_err(msg),
        Kind::NoServer => NoServer::new_err(msg),
    }
}

/// `ContentMismatch` with its attributes: `generation`, `committed`, `expected`, `computed`.
fn content_mismatch(py: Python<'_>, e: &Error, msg: String) -> PyErr {
    let err = ContentMismatch::new_err(msg);
    let (generation, committed, expected, computed) = match e {
        Error::TensorSet(TensorSetError::ContentMismatch {
            generation,
            expected,
            found,
        }) => (*generation, *found, Some(*expected), None),
        Error::TensorSet(TensorSetError::ContentUnverified {
            generation,
            committed,
            computed,
        }) => (*generation, *committed, None, Some(*computed)),
        _ => return err,
    };
    let v = err.value(py);
    let bytes = |b: Option<[u8; 32]>| b.map(|b| PyBytes::new(py, &b));
    let set = v
        .setattr("generation", generation)
        .and_then(|()| v.setattr("committed", PyBytes::new(py, &committed)))
        .and_then(|()| v.setattr("expected", bytes(expected)))
        .and_then(|()| v.setattr("computed", bytes(computed)));
    match set {
        Ok(()) => err,
        Err(set_err) => set_err,
    }
}

/// `NotSupported` for `what` (`"channel consumer"`) used in a process forked from the one that
/// made it (`cuda_ipc::Error::ForkedChild`): raised before any lock a thread of the parent may
/// have held at the fork is taken.
pub(crate) fn forked(what: &'static str) -> PyErr {
    NotSupported::new_err(Error::ForkedChild { what }.to_string())
}

/// `Ok` in the process that made an object whose fork epoch is `fork`; in a process forked from
/// it, [`forked`]`(what)`. One relaxed atomic load: no lock, no system call, no driver call, so
/// it comes first in every call of a class that has state of its parent's.
pub(crate) fn check_fork(fork: ForkEpoch, what: &'static str) -> PyResult<()> {
    if fork.inherited() {
        return Err(forked(what));
    }
    Ok(())
}

/// `TensorSetClosed` for a call on a tensor-set reader or holder (`what`) that was closed by its
/// own `close()`: the message names that object, not the writer, whose set may still be published.
/// The same class as the writer's close, so that a loop stopping at `TensorSetClosed` stops for
/// either.
pub(crate) fn closed_here(what: &str, name: &str) -> PyErr {
    TensorSetClosed::new_err(format!(
        "this {what} of tensor set {name:?} is closed (by its own close(), not by the writer)"
    ))
}

/// `ValueError`-like `InvalidArgument` for arguments checked here rather than in the crate.
pub(crate) fn invalid_argument(py: Python<'_>, msg: String) -> PyErr {
    to_py(py, &Error::InvalidArgument(msg))
}

/// `NotSupported` for what a host-memory channel has not (a device buffer, a stream, DLPack) and
/// what a GPU channel has not (host bytes).
pub(crate) fn not_supported(msg: &str) -> PyErr {
    NotSupported::new_err(msg.to_string())
}

/// How the extension's messages write a count (`1 byte`, `2 bytes`): the library's own spelling.
pub(crate) use cuda_ipc::error::{bytes, plural};
