//! The fd servers' socket files: where one lives, what is at a path, who holds the other end of a
//! connection, and the files dead servers left behind.
//!
//! Owns: the socket path of an exporter ([`socket_path`], [`SOCKET_PREFIX`]), the description of
//! whatever is at a path (for errors), `SO_PEERCRED` ([`PeerCred`]), and the listing and removal of
//! dead processes' socket files ([`stale_socket_files`], [`remove_stale_socket_file`], for
//! `cuda-ipc gc`). The server (`server.rs`) and the importer (`fetch.rs`) both build on it; it
//! imports neither, and opens no connection.

use crate::error::{OsError, Result};
use crate::identity::{Liveness, ProcessIdentity};
use rustix::io::Errno;
use std::os::fd::{AsFd, AsRawFd};

/// Directory of the servers' socket files: the POSIX shared-memory directory, which containers that
/// share segments share too (whatever their network namespaces).
const SOCKET_DIR: &str = "/dev/shm";
/// Prefix of a server socket file's name in `/dev/shm`.
pub const SOCKET_PREFIX: &str = "cuda-ipc.fd.";

/// The path of `exporter`'s fd server socket:
/// `/dev/shm/cuda-ipc.fd.<pid ns>.<pid>.<start time>` (decimal numbers: the inode number of its
/// pid namespace, its pid in that namespace, its start time in clock ticks since boot). At most 63
/// bytes, well within the 108 of a Unix socket address.
pub fn socket_path(exporter: &ProcessIdentity) -> String {
    format!("{SOCKET_DIR}/{}", socket_file_name(exporter))
}

/// The file name (in `/dev/shm`) of `exporter`'s fd server socket.
pub(super) fn socket_file_name(exporter: &ProcessIdentity) -> String {
    exporter.file_name(SOCKET_PREFIX)
}

/// What is at `path`, in words, without following a symbolic link.
pub(super) fn describe_path(path: &str) -> String {
    use rustix::fs::FileType;
    match rustix::fs::lstat(path) {
        Ok(st) => match FileType::from_raw_mode(st.st_mode) {
            FileType::Socket => "a socket",
            FileType::Fifo => "a FIFO",
            FileType::RegularFile => "a regular file",
            FileType::Directory => "a directory",
            FileType::Symlink => "a symbolic link",
            FileType::CharacterDevice => "a character device",
            FileType::BlockDevice => "a block device",
            FileType::Unknown => "a file of unknown type",
        }
        .to_string(),
        Err(Errno::NOENT) => "nothing".to_string(),
        Err(e) => format!("unknown: lstat failed: {e}"),
    }
}

/// The credentials of a Unix socket's peer (`SO_PEERCRED`): the pid as seen from this process's
/// pid namespace (0 when the peer is not visible in it) and the effective uid.
#[derive(Clone, Copy, Debug)]
pub(super) struct PeerCred {
    pub(super) pid: u32,
    pub(super) uid: u32,
}

/// `getsockopt(SO_PEERCRED)`, through libc: a peer in a pid namespace this process cannot see has
/// pid 0, which a non-zero pid type could not hold.
pub(super) fn peer_cred(sock: &impl AsFd) -> std::result::Result<PeerCred, Errno> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `sock` is an open descriptor; `cred` and `len` are valid for writes and `len` holds
    // the size of `cred`, which the kernel does not exceed.
    let r = unsafe {
        libc::getsockopt(
            sock.as_fd().as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(Errno::from_io_error(&std::io::Error::last_os_error()).unwrap_or(Errno::IO));
    }
    if len as usize != std::mem::size_of::<libc::ucred>() {
        return Err(Errno::INVAL);
    }
    Ok(PeerCred {
        pid: u32::try_from(cred.pid).unwrap_or(0),
        uid: cred.uid,
    })
}

/// An fd server's socket file in `/dev/shm` whose process is dead, found by [`stale_socket_files`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StaleSocketFile {
    /// The file's name in `/dev/shm` (`cuda-ipc.fd.<pid ns>.<pid>.<start time>`).
    pub name: String,
    /// The identity of the process that made it (boot id: this boot's).
    pub identity: ProcessIdentity,
    /// Owner uid of the file.
    pub uid: u32,
}

/// The fd server socket files in `/dev/shm` whose processes are dead ([`ProcessIdentity::liveness`]
/// says `Dead`; `Unknown` is left out): left by killed exporters (a normal exit removes the file).
/// Entries that are not sockets, or whose names do not parse, are left out. For `cuda-ipc gc`;
/// nothing is removed here.
///
/// # Errors
/// [`Error::Os`](crate::Error::Os) when `/dev/shm` cannot be listed or the boot id cannot be read.
pub fn stale_socket_files() -> Result<Vec<StaleSocketFile>> {
    let boot = crate::identity::boot_id()?;
    let dir = std::fs::read_dir(SOCKET_DIR).map_err(|e| OsError::io("opendir", SOCKET_DIR, e))?;
    let mut out = Vec::new();
    for ent in dir.flatten() {
        let Some(name) = ent.file_name().to_str().map(str::to_string) else {
            continue;
        };
        let Some(identity) = parse_socket_name(&name, boot) else {
            continue;
        };
        let Ok(st) = rustix::fs::lstat(format!("{SOCKET_DIR}/{name}").as_str()) else {
            continue;
        };
        if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::Socket {
            continue;
        }
        // The socket's owner is its process's uid: a liveness file of anyone else (or root)
        // under that process's name does not keep it alive.
        if identity.liveness_as(st.st_uid) == Liveness::Dead {
            out.push(StaleSocketFile {
                name,
                identity,
                uid: st.st_uid,
            });
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// Removes a stale socket file (see [`stale_socket_files`]) after checking once more that it is a
/// socket of the same owner, named for `file.identity`, and that this process is dead. Returns
/// `false` when it was not removed: gone already, alive (never, for a dead process: a guard against
/// a mistaken entry), or no longer that socket.
///
/// # Errors
/// [`Error::Os`](crate::Error::Os) when `unlink` fails for a reason other than the file being gone
/// (e.g. `EPERM`: a file of another user in the sticky `/dev/shm`, for a caller other than root).
pub fn remove_stale_socket_file(file: &StaleSocketFile) -> Result<bool> {
    if file.name != socket_file_name(&file.identity) {
        return Ok(false);
    }
    let path = format!("{SOCKET_DIR}/{}", file.name);
    let Ok(st) = rustix::fs::lstat(path.as_str()) else {
        return Ok(false);
    };
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::Socket
        || st.st_uid != file.uid
        || file.identity.liveness_as(file.uid) != Liveness::Dead
    {
        return Ok(false);
    }
    match rustix::fs::unlink(path.as_str()) {
        Ok(()) => Ok(true),
        Err(Errno::NOENT) => Ok(false),
        Err(e) => Err(OsError::new("unlink", path, e).into()),
    }
}

/// Parses `cuda-ipc.fd.<ns>.<pid>.<start>` into an identity of boot `boot`.
fn parse_socket_name(name: &str, boot: [u8; 16]) -> Option<ProcessIdentity> {
    crate::identity::parse_file_name(SOCKET_PREFIX, name, boot)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_socket_path_is_pid_namespace_pid_and_start_time_in_dev_shm() {
        let id = ProcessIdentity {
            pid: 12,
            start_time: 345,
            boot_id: [0; 16],
            pid_ns: 4026531836,
        };
        assert_eq!(socket_path(&id), "/dev/shm/cuda-ipc.fd.4026531836.12.345");
        assert_eq!(
            parse_socket_name("cuda-ipc.fd.4026531836.12.345", [0; 16]),
            Some(id)
        );
        assert_eq!(parse_socket_name("cuda-ipc.fd.1.2", [0; 16]), None);
        assert_eq!(parse_socket_name("cuda-ipc.fd.1.2.3.4", [0; 16]), None);
        assert_eq!(parse_socket_name("cuda-ipc.live.1.2.3", [0; 16]), None);
        let longest = ProcessIdentity {
            pid: u32::MAX,
            start_time: u64::MAX,
            boot_id: [0; 16],
            pid_ns: u32::MAX,
        };
        assert!(socket_path(&longest).len() < 108);
    }
}
