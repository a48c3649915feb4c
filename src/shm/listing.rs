//! What stands in [`SHM_DIR`] under this crate's names, listed without opening anything: the
//! names a tool lists (every user's, this user's, other users'), and the files of given inodes
//! (a quota ledger's dead holders' segments). [`Segment`](super::Segment) opens one of them.

use super::segment::{SHM_DIR, validate_name};
use crate::error::{OsError, Result};

/// Names of the shared-memory objects in [`SHM_DIR`] that could be segments of this crate: regular
/// files whose names pass [`validate_name`], sorted. Whose they are and what they hold is not
/// checked here.
///
/// # Errors
/// [`crate::Error::Os`] when the folder cannot be read.
pub fn list_segments() -> Result<Vec<String>> {
    let dir = std::fs::read_dir(SHM_DIR).map_err(|e| OsError::io("read_dir", SHM_DIR, e))?;
    let mut out = Vec::new();
    for entry in dir {
        let entry = entry.map_err(|e| OsError::io("read_dir", SHM_DIR, e))?;
        // The entry's own type (no symlink is followed): only plain files are segments.
        if !entry.file_type().is_ok_and(|t| t.is_file()) {
            continue;
        }
        if let Some(name) = entry.file_name().to_str()
            && validate_name(name).is_ok()
        {
            out.push(name.to_string());
        }
    }
    out.sort();
    Ok(out)
}

/// Every name in [`SHM_DIR`] that passes [`validate_name`], whatever stands there (a regular
/// file, a FIFO, a directory, a symbolic link, a socket), with its owner's uid and, for anything
/// but a regular file, what it is (`lstat`: no link is followed, nothing is opened), sorted. A
/// name gone meanwhile is left out.
///
/// For listings of this crate's objects: whatever stands under one of its names blocks the
/// creation of that object (`O_EXCL`), so a tool lists it, and the opener that meets it says
/// what it is ([`ShmError::NotASegment`](super::ShmError::NotASegment)).
///
/// # Errors
/// [`crate::Error::Os`] when the folder cannot be read.
pub(crate) fn list_names() -> Result<Vec<(String, u32, Option<&'static str>)>> {
    use std::os::unix::fs::MetadataExt;
    let dir = std::fs::read_dir(SHM_DIR).map_err(|e| OsError::io("read_dir", SHM_DIR, e))?;
    let mut out = Vec::new();
    for entry in dir {
        let entry = entry.map_err(|e| OsError::io("read_dir", SHM_DIR, e))?;
        let Some(name) = entry.file_name().to_str().map(str::to_string) else {
            continue;
        };
        if validate_name(&name).is_err() {
            continue;
        }
        // `DirEntry::metadata` is `lstat`: the entry itself, never what a link points to.
        let Ok(m) = entry.metadata() else {
            continue;
        };
        let kind = (!m.file_type().is_file()).then(|| file_kind(m.file_type()));
        out.push((name, m.uid(), kind));
    }
    out.sort();
    Ok(out)
}

/// The regular files in [`SHM_DIR`] that `wanted` accepts by inode and name, as (inode, name):
/// one pass over the folder's entries (`getdents`: the inode numbers come with the names, nothing
/// is opened or followed; only an accepted entry's type is looked at). Empty when the folder
/// cannot be read.
pub(crate) fn names_of_inodes(wanted: impl Fn(u64, &str) -> bool) -> Vec<(u64, String)> {
    use std::os::unix::fs::DirEntryExt;
    let Ok(dir) = std::fs::read_dir(SHM_DIR) else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| Some((e.ino(), e.file_name().to_str()?.to_string(), e)))
        .filter(|(ino, name, _)| wanted(*ino, name))
        .filter(|(.., e)| e.file_type().is_ok_and(|t| t.is_file()))
        .map(|(ino, name, _)| (ino, name))
        .collect()
}

/// What a file of type `t` is, in the words of
/// [`ShmError::NotASegment`](super::ShmError::NotASegment) (for the listings, and for an opener
/// that finds a name standing for something other than a segment).
pub(crate) fn file_kind(t: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if t.is_dir() {
        "directory"
    } else if t.is_symlink() {
        "symbolic link"
    } else if t.is_fifo() {
        "FIFO"
    } else if t.is_socket() {
        "socket"
    } else if t.is_char_device() {
        "character device"
    } else if t.is_block_device() {
        "block device"
    } else if t.is_file() {
        "regular file"
    } else {
        "special file"
    }
}

/// The names in [`SHM_DIR`] of this process's effective user, whatever stands under them (a
/// segment, or a FIFO, directory, symbolic link or socket that blocks a segment's creation there:
/// listings show it, and its opener says what it is), sorted. Another user's names are left
/// out: their segments cannot be opened here (`WrongOwner`) and are not ours to clean
/// ([`list_other_users_names`]). A name gone meanwhile is left out too.
///
/// # Errors
/// As [`list_segments`].
pub(crate) fn list_own_names() -> Result<Vec<String>> {
    let me = rustix::process::geteuid().as_raw();
    Ok(list_names()?
        .into_iter()
        .filter(|(_, uid, _)| *uid == me)
        .map(|(n, ..)| n)
        .collect())
}

/// The names [`list_own_names`] leaves out: those of users other than this process's effective
/// user, whatever stands under them, each with its owner's uid (from `lstat`) and, for anything
/// but a regular file, what it is (`"FIFO"`, `"directory"`, `"symbolic link"`, ...; `None` for a
/// segment). Their bytes are not read.
///
/// # Errors
/// As [`list_segments`].
pub(crate) fn list_other_users_names() -> Result<Vec<(String, u32, Option<&'static str>)>> {
    let me = rustix::process::geteuid().as_raw();
    Ok(list_names()?
        .into_iter()
        .filter(|(_, uid, _)| *uid != me)
        .collect())
}

/// The owner's uid of name `name` and what stands there when [`list_other_users_names`] would
/// list it: a valid segment name (from `lstat`: no link is followed, nothing is opened) of a user
/// other than this process's effective user, with `None` for a regular file or what else it is
/// (`"FIFO"`, ...); `None` for this user's, for an invalid name, and when nothing stands under
/// it. For a look at one name (a `gc` of a NAME) by the rule of the listing.
pub(crate) fn other_users_name(name: &str) -> Option<(u32, Option<&'static str>)> {
    use std::os::unix::fs::MetadataExt;
    validate_name(name).ok()?;
    let m = std::fs::symlink_metadata(format!("{SHM_DIR}/{name}")).ok()?;
    let me = rustix::process::geteuid().as_raw();
    let kind = (!m.file_type().is_file()).then(|| file_kind(m.file_type()));
    (m.uid() != me).then_some((m.uid(), kind))
}
