//! What VMM allocations (`vmm.rs`) and exportable memory pools (`pool.rs`) share: POSIX file
//! descriptors as the shareable handle type, the device location and access descriptors, the check
//! that an importing device can reach the exporter's, and the fetch of an exporter's fd with this
//! process's choice of transport ([`set_fd_transport`]).
//!
//! Owns: that transport choice and the fetch timeout. Imports neither `vmm.rs` nor `pool.rs`; both
//! build on it. File descriptors travel through [`super::fdpass`].
//!
//! Who closes a file descriptor: [`fetch_fd`] returns the importer's own copy, and its caller closes
//! (drops) it right after `cuMemImportFromShareableHandle` / `cuMemPoolImportFromShareableHandle`,
//! on success and on failure: the driver does not take ownership of a POSIX fd handle.

use super::cache::{self, lock};
use super::fdpass::{self, FdTransport};
use crate::driver::{Context, Device};
use crate::error::{Error, Result};
use crate::ffi::{check, sys};
use crate::token::Token;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long an import waits for the exporter to hand over a file descriptor.
const FETCH_TIMEOUT: Duration = Duration::from_secs(5);

/// This process's fd transport: `None` until [`set_fd_transport`] or the first [`fd_transport`].
static TRANSPORT: Mutex<Option<FdTransport>> = Mutex::new(None);

/// Sets how this process fetches the file descriptors of VMM and pool tokens it imports:
/// [`FdTransport::Socket`] (the default: SCM_RIGHTS over the exporter's Unix socket, needs no
/// special rights), or `pidfd_getfd(2)` first ([`FdTransport::PidfdThenSocket`], needs ptrace
/// rights over the exporter). Without a call, the environment variable `CUDA_IPC_FD_TRANSPORT`
/// (`socket`, `pidfd`, `pidfd-only`) decides.
pub fn set_fd_transport(t: FdTransport) {
    *lock(&TRANSPORT) = Some(t);
}

/// The transport imports use now (see [`set_fd_transport`]).
pub fn fd_transport() -> FdTransport {
    let mut t = lock(&TRANSPORT);
    *t.get_or_insert_with(|| match std::env::var("CUDA_IPC_FD_TRANSPORT").as_deref() {
        Ok("pidfd") => FdTransport::PidfdThenSocket,
        Ok("pidfd-only") => FdTransport::PidfdOnly,
        _ => FdTransport::Socket,
    })
}

/// The location of memory on `dev` (`CU_MEM_LOCATION_TYPE_DEVICE`).
pub(super) fn location(dev: &Device) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: dev.raw(),
    }
}

/// Read/write access for `dev`, for `cuMemSetAccess` and `cuMemPoolSetAccess`.
pub(super) fn access_desc(dev: &Device) -> sys::CUmemAccessDesc {
    access_desc_for(dev, super::cache::Access::ReadWrite)
}

/// `access` for `dev` (read-only: `CU_MEM_ACCESS_FLAGS_PROT_READ`), for `cuMemSetAccess`.
pub(super) fn access_desc_for(dev: &Device, access: super::cache::Access) -> sys::CUmemAccessDesc {
    sys::CUmemAccessDesc {
        location: location(dev),
        flags: match access {
            super::cache::Access::ReadOnly => sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ,
            _ => sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        },
    }
}

/// The shareable handle type of every export here: a POSIX file descriptor.
pub(super) const POSIX_FD: sys::CUmemAllocationHandleType =
    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;

/// Fails with a clear error when `ctx`'s device cannot reach memory on the device `owner`.
pub(super) fn require_peer(ctx: &Arc<Context>, owner: crate::driver::Uuid) -> Result<()> {
    let here = ctx.device();
    if here.uuid() == owner {
        return Ok(());
    }
    let Ok(dev) = Device::by_uuid(owner) else {
        // Not visible here: the driver's own mapping call decides.
        return Ok(());
    };
    let mut ok = 0i32;
    // SAFETY: both are valid device handles of a loaded driver; `ok` a valid out-pointer.
    check("cuDeviceCanAccessPeer", unsafe {
        sys::cuDeviceCanAccessPeer(&mut ok, here.raw(), dev.raw())
    })?;
    if ok == 0 {
        return Err(Error::Unsupported {
            what: "importing memory of another GPU",
            reason: format!(
                "device {} cannot access device {owner} (no peer access)",
                here.uuid()
            ),
            fix: "import on the device that holds the memory",
        });
    }
    Ok(())
}

/// Fetches the fd a VMM or pool token names from its exporter (at most [`FETCH_TIMEOUT`]): with
/// this process's [`fd_transport`], or over the socket when the token carries no fd number
/// (`raw_fd < 0`, as pool tokens). The caller owns the returned fd and closes (drops) it after the
/// import, on success and on failure.
pub(super) fn fetch_fd(token: &Token, raw_fd: i32) -> Result<OwnedFd> {
    let transport = if raw_fd < 0 {
        FdTransport::Socket
    } else {
        fd_transport()
    };
    let started = std::time::Instant::now();
    let fd = fdpass::fetch(
        &token.exporter,
        token.export_id,
        raw_fd,
        transport,
        FETCH_TIMEOUT,
    );
    cache::add_fetch_time(started.elapsed());
    let fd = fd?;
    cache::bump(&cache::FD_FETCHES);
    Ok(fd)
}
