//! What VMM allocations (`vmm.rs`) and exportable memory pools (`pool.rs`) share: POSIX file
//! descriptors as the shareable handle type, the device location and access descriptors, the check
//! that an importing device can reach the exporter's, and the fetch of an exporter's fd with this
//! process's choice of transport ([`set_fd_transport`]).
//!
//! Owns: that transport choice and the fetch timeout, and the default source of a batched import's
//! fds ([`fetch_from_exporters`]: one round trip per exporter). Imports neither `vmm.rs` nor `pool.rs`; both
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
use crate::identity::ProcessIdentity;
use crate::token::{Token, TokenKind};
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

/// Where a batched import gets the fds of the VMM allocations it has not imported yet: given those
/// tokens, one fd per token in the same order, or an error and no fd (all or nothing). The caller
/// owns the fds and closes each right after its import. The default is [`fetch_from_exporters`];
/// any process holding the fds could serve them as well.
pub(crate) type FdSource<'a> = &'a mut dyn FnMut(&[&Token]) -> Result<Vec<OwnedFd>>;

/// The default [`FdSource`]: the fds of `tokens` from their exporters, one
/// [`fdpass::fetch_many`] round trip per exporter (in the order each exporter first appears,
/// up to [`FETCH_TIMEOUT`] each), with this process's [`fd_transport`] (the socket for a token
/// without an fd number). Returns them in the order of `tokens`; on an error none is left open.
/// `owner`: the uid every exporter runs as, where the caller knows it (the owner of a segment the
/// exporter made and this process checked): its socket and liveness are then checked against it
/// ([`fdpass::fetch_many_from_uid`]).
///
/// # Errors
/// As [`fdpass::fetch_many`].
pub(crate) fn fetch_from_exporters(tokens: &[&Token], owner: Option<u32>) -> Result<Vec<OwnedFd>> {
    fetch_from_exporters_then(tokens, owner, &mut || {})
}

/// [`fetch_from_exporters`], running `waiting` once while the first exporter prepares its answer
/// ([`fdpass::fetch_many_then`]: not at all where no request goes over a socket).
///
/// # Errors
/// As [`fetch_from_exporters`].
pub(crate) fn fetch_from_exporters_then(
    tokens: &[&Token],
    owner: Option<u32>,
    waiting: &mut dyn FnMut(),
) -> Result<Vec<OwnedFd>> {
    let mut waiting = Some(waiting);
    let mut out: Vec<Option<OwnedFd>> = (0..tokens.len()).map(|_| None).collect();
    for (exporter, at) in by_exporter(tokens) {
        let ids: Vec<(u32, i32)> = at
            .iter()
            .map(|&i| (tokens[i].export_id, raw_fd_of(tokens[i])))
            .collect();
        let transport = if ids.iter().any(|&(_, fd)| fd < 0) {
            FdTransport::Socket
        } else {
            fd_transport()
        };
        let mut idle = || {};
        let w = waiting.take().unwrap_or(&mut idle);
        let fds = fdpass::fetch_many_then(&exporter, owner, &ids, transport, FETCH_TIMEOUT, w)?;
        if fds.len() != at.len() {
            return Err(Error::InvalidArgument(format!(
                "{} fds fetched for {} exports",
                fds.len(),
                at.len()
            )));
        }
        for (i, fd) in at.into_iter().zip(fds) {
            out[i] = Some(fd);
        }
    }
    // Every index belongs to exactly one exporter's group, so every slot is filled.
    out.into_iter()
        .map(|fd| fd.ok_or_else(|| Error::InvalidArgument("an fd was not fetched".into())))
        .collect()
}

/// The fd number a token carries for `pidfd_getfd` (VMM tokens: the handle's first 4 bytes); -1
/// for other kinds (fetched over the socket by id).
fn raw_fd_of(token: &Token) -> i32 {
    match token.kind {
        TokenKind::VmmMemory => {
            i32::from_le_bytes(token.handle[..4].try_into().unwrap_or([0xff; 4]))
        }
        _ => -1,
    }
}

/// The positions of `tokens` grouped by exporter: each exporter once, in the order it first
/// appears, with its tokens' positions in their order.
pub(crate) fn by_exporter(tokens: &[&Token]) -> Vec<(ProcessIdentity, Vec<usize>)> {
    let mut groups: Vec<(ProcessIdentity, Vec<usize>)> = Vec::new();
    for (i, t) in tokens.iter().enumerate() {
        match groups.iter_mut().find(|(e, _)| *e == t.exporter) {
            Some((_, at)) => at.push(i),
            None => groups.push((t.exporter, vec![i])),
        }
    }
    groups
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
    cache::add_import_time(cache::ImportStep::FdFetch, started.elapsed());
    let fd = fd?;
    cache::bump(&cache::FD_FETCHES);
    Ok(fd)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::Uuid;
    use crate::ipc::fdpass::FdExport;
    use std::io::{Read, Seek, Write};

    fn vmm_token(exporter: ProcessIdentity, export_id: u32, raw_fd: i32) -> Token {
        let mut handle = [0u8; 64];
        handle[..4].copy_from_slice(&raw_fd.to_le_bytes());
        Token {
            kind: TokenKind::VmmMemory,
            handle,
            offset: 0,
            len: 1,
            device: Uuid([0; 16]),
            exporter,
            export_id,
        }
    }

    #[test]
    fn tokens_are_grouped_by_exporter_in_order_of_first_appearance() {
        let id = |pid| ProcessIdentity {
            pid,
            start_time: 5,
            boot_id: [1; 16],
            pid_ns: 2,
        };
        let t: Vec<Token> = [3, 2, 3, 4, 2, 3]
            .iter()
            .enumerate()
            .map(|(i, &pid)| vmm_token(id(pid), i as u32 + 1, 10))
            .collect();
        let refs: Vec<&Token> = t.iter().collect();
        let groups = by_exporter(&refs);
        let got: Vec<(u32, Vec<usize>)> = groups.into_iter().map(|(e, at)| (e.pid, at)).collect();
        assert_eq!(got, [(3, vec![0, 2, 5]), (2, vec![1, 4]), (4, vec![3])]);
        assert!(by_exporter(&[]).is_empty());
    }

    fn memfd(text: &str) -> OwnedFd {
        let fd = rustix::fs::memfd_create("batch-test", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        let mut f = std::fs::File::from(fd);
        f.write_all(text.as_bytes()).unwrap();
        f.into()
    }

    fn text(fd: OwnedFd) -> String {
        let mut f = std::fs::File::from(fd);
        f.rewind().unwrap();
        let mut s = String::new();
        f.read_to_string(&mut s).unwrap();
        s
    }

    #[test]
    fn the_exporters_serve_a_batch_in_the_order_asked_all_or_nothing() {
        let me = ProcessIdentity::current().unwrap();
        let ex: Vec<FdExport> = ["a", "b", "c"]
            .iter()
            .map(|s| FdExport::new(memfd(s)).unwrap())
            .collect();
        let t: Vec<Token> = [2, 0, 1]
            .iter()
            .map(|&i| vmm_token(me, ex[i].id(), ex[i].raw_fd()))
            .collect();
        let refs: Vec<&Token> = t.iter().collect();
        let fds = fetch_from_exporters(&refs, None).unwrap();
        let got: Vec<String> = fds.into_iter().map(text).collect();
        assert_eq!(got, ["c", "a", "b"]);
        // One export withdrawn: the batch fails and hands out nothing.
        let gone = vmm_token(me, u32::MAX, -1);
        let refs = [&t[0], &gone, &t[1]];
        let e = fetch_from_exporters(&refs, None).unwrap_err();
        assert!(
            matches!(
                e,
                Error::FdPass(crate::ipc::FdPassError::NotOffered { id: u32::MAX, .. })
            ),
            "{e}"
        );
    }
}
