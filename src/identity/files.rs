//! The liveness files of other processes in `/dev/shm`: which are stale (their process was
//! killed: the lock free, the file old enough), what stands under their names that is no liveness
//! file (never removed), their removal after a second look, and the parse of a per-process file
//! name back into an identity.

use super::lock::{LockState, open_live_file, probe_lock, test_lock};
use super::proc::boot_id;
use super::{LIVE_DIR, LIVE_PREFIX, ProcessIdentity};
use crate::error::{OsError, Result};

/// A liveness file found in `/dev/shm` by [`stale_liveness_files`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LivenessFile {
    /// The file's name in `/dev/shm`.
    pub name: String,
    /// The identity it stands for (boot id: this boot's).
    pub identity: ProcessIdentity,
    /// Owner uid of the file.
    pub uid: u32,
}

/// The liveness files in `/dev/shm` whose lock is free: their processes were killed (a normal exit
/// removes the file). Left out: what is no liveness file as this crate makes it (an empty regular
/// file of mode 0644 with one link; [`not_liveness_files`] lists the rest), files whose lock
/// cannot be tested, those made less than 5 s ago (a process starting up locks its file right
/// after making it), and those whose process `/proc` shows running in our pid namespace (same
/// pid, same start time). For `cuda-ipc gc`; nothing is removed here.
///
/// # Errors
/// [`crate::Error::Os`] when `/dev/shm` cannot be listed.
pub fn stale_liveness_files() -> Result<Vec<LivenessFile>> {
    free_liveness_files(true)
}

/// The liveness files in `/dev/shm` whose lock is free but that were made less than 5 s ago
/// ([`LIVENESS_FILE_GRACE`]): the ones [`stale_liveness_files`] leaves out for their age. A
/// process starting up (between making its file and locking it), or one killed within 5 s of its
/// start: which cannot be told yet. For `cuda-ipc gc`, which lists them as kept, with why;
/// nothing is removed here.
///
/// # Errors
/// [`crate::Error::Os`] when `/dev/shm` cannot be listed.
pub fn young_free_liveness_files() -> Result<Vec<LivenessFile>> {
    free_liveness_files(false)
}

/// Something under a liveness file's name that is not what this crate makes there (an empty
/// regular file of mode 0644 with one link): another user's data, a link, a FIFO, a directory.
/// Listed by [`not_liveness_files`] for `cuda-ipc gc` to report as a problem; never removed, by
/// anyone, root included.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NotLivenessFile {
    /// The name in `/dev/shm`.
    pub name: String,
    /// Owner uid of what stands under the name (not followed, for a link).
    pub uid: u32,
    /// What it is, in words: `a symbolic link`, `a file of 16 bytes`, `a file of mode 0600`, ...
    pub what: String,
}

/// What stands under the liveness file names in `/dev/shm` made at least
/// [`LIVENESS_FILE_GRACE`] ago that is not a liveness file (see [`NotLivenessFile`]); younger
/// ones are not judged yet (the file of a starting process gets its mode right after it is made).
/// For `cuda-ipc gc`, which names each as a problem; nothing is removed here.
///
/// # Errors
/// [`crate::Error::Os`] when `/dev/shm` cannot be listed.
pub fn not_liveness_files() -> Result<Vec<NotLivenessFile>> {
    Ok(scan_liveness_names(true)?.1)
}

/// The liveness files whose lock is free, `old` (at least [`LIVENESS_FILE_GRACE`] old) or young.
fn free_liveness_files(old: bool) -> Result<Vec<LivenessFile>> {
    Ok(scan_liveness_names(old)?.0)
}

/// Walks `/dev/shm` for names of the liveness file form of this boot made `old` (or young): the
/// genuine liveness files that are free and whose process `/proc` does not show running, and what
/// stands under such a name that is no liveness file.
fn scan_liveness_names(old: bool) -> Result<(Vec<LivenessFile>, Vec<NotLivenessFile>)> {
    let boot = boot_id()?;
    let dir = std::fs::read_dir(LIVE_DIR).map_err(|e| OsError::io("opendir", LIVE_DIR, e))?;
    let mut free = Vec::new();
    let mut foreign = Vec::new();
    for ent in dir.flatten() {
        let Some(name) = ent.file_name().to_str().map(str::to_string) else {
            continue;
        };
        let Some(identity) = parse_file_name(LIVE_PREFIX, &name, boot) else {
            continue;
        };
        // Only the name this crate writes for the identity (`014` or `+14` is none of ours).
        if identity.liveness_name() != name {
            continue;
        }
        match judge(&name) {
            Judged::Gone => {}
            Judged::Foreign { st, what } => {
                if old_enough(&st) == old {
                    foreign.push(NotLivenessFile {
                        name,
                        uid: st.st_uid,
                        what,
                    });
                }
            }
            Judged::Liveness { fd, st } => {
                if old_enough(&st) == old
                    && matches!(test_lock(&fd), Ok(false))
                    && !runs_here(&identity)
                {
                    free.push(LivenessFile {
                        name,
                        identity,
                        uid: st.st_uid,
                    });
                }
            }
        }
    }
    free.sort_by(|a, b| a.name.cmp(&b.name));
    foreign.sort_by(|a, b| a.name.cmp(&b.name));
    Ok((free, foreign))
}

/// Whether `/proc` of our own pid namespace shows the process of `id` running (same pid, same
/// start time, no zombie): then a free lock on its file does not make it dead (it may be between
/// making its file and locking it, or the file is a forgery), as in [`ProcessIdentity::liveness`].
fn runs_here(id: &ProcessIdentity) -> bool {
    id.proc_answers() && id.proc_liveness(None) == super::Liveness::Alive
}

/// What stands under a liveness file name in `/dev/shm`.
enum Judged {
    /// Nothing (any more), or it changed while it was looked at.
    Gone,
    /// Something this crate does not make there; `st` of the name itself (never followed).
    Foreign { st: rustix::fs::Stat, what: String },
    /// A liveness file, open (read-only) as the inode the name stands for.
    Liveness {
        fd: std::os::fd::OwnedFd,
        st: rustix::fs::Stat,
    },
}

/// Checks that `name` is a liveness file as [`super::lock`] makes it: a regular file (never a
/// link followed, never a FIFO waited on), one link, mode 0644, empty (at most one byte read).
fn judge(name: &str) -> Judged {
    use rustix::fs::FileType as T;
    let path = format!("{LIVE_DIR}/{name}");
    let Ok(lst) = rustix::fs::lstat(path.as_str()) else {
        return Judged::Gone;
    };
    let foreign = |st: rustix::fs::Stat, what: String| Judged::Foreign { st, what };
    let kind = match T::from_raw_mode(lst.st_mode) {
        T::RegularFile => None,
        T::Symlink => Some("a symbolic link"),
        T::Fifo => Some("a FIFO"),
        T::Directory => Some("a directory"),
        T::Socket => Some("a socket"),
        T::CharacterDevice => Some("a character device"),
        T::BlockDevice => Some("a block device"),
        _ => Some("a special file"),
    };
    if let Some(k) = kind {
        return foreign(lst, k.to_string());
    }
    let mode = lst.st_mode & 0o7777;
    if mode != 0o644 {
        return foreign(lst, format!("a file of mode {mode:04o}"));
    }
    if lst.st_nlink != 1 {
        return foreign(
            lst,
            format!("a file of {}", crate::error::plural(lst.st_nlink, "link")),
        );
    }
    if lst.st_size != 0 {
        return foreign(
            lst,
            format!("a file of {}", crate::error::bytes(lst.st_size)),
        );
    }
    let Ok(fd) = open_live_file(&path, false) else {
        return Judged::Gone;
    };
    let Ok(st) = rustix::fs::fstat(&fd) else {
        return Judged::Gone;
    };
    // The inode opened must be the one judged by name, and still as judged.
    if st.st_ino != lst.st_ino
        || st.st_dev != lst.st_dev
        || T::from_raw_mode(st.st_mode) != T::RegularFile
        || st.st_mode & 0o7777 != 0o644
        || st.st_nlink != 1
        || st.st_size != 0
    {
        return Judged::Gone;
    }
    // Empty as a liveness file is: read one byte at most.
    let mut b = [0u8; 1];
    match rustix::io::pread(&fd, &mut b, 0) {
        Ok(0) => Judged::Liveness { fd, st },
        Ok(_) => foreign(st, "a file with contents".into()),
        Err(_) => Judged::Gone,
    }
}

/// Removes a stale liveness file (see [`stale_liveness_files`]) after judging it once more: it
/// must still be a liveness file (as [`not_liveness_files`] tells them apart: anything else
/// under the name is never removed), made at least [`LIVENESS_FILE_GRACE`] ago, its lock free,
/// its process not running in our pid namespace; and the name must still stand for the inode
/// judged. Returns `false` when it was not removed: it is gone already, or any of these no longer
/// holds (never, for a dead process's file; a guard against a mistaken or forged name).
///
/// # Errors
/// [`crate::Error::Os`] when `unlink` fails for a reason other than the file being gone.
pub fn remove_stale_liveness_file(file: &LivenessFile) -> Result<bool> {
    let Ok(boot) = boot_id() else {
        return Ok(false);
    };
    match parse_file_name(LIVE_PREFIX, &file.name, boot) {
        Some(id) if id == file.identity && id.liveness_name() == file.name => {}
        _ => return Ok(false),
    }
    let Judged::Liveness { fd, st } = judge(&file.name) else {
        return Ok(false);
    };
    if !old_enough(&st) || !matches!(test_lock(&fd), Ok(false)) || runs_here(&file.identity) {
        return Ok(false);
    }
    let path = format!("{LIVE_DIR}/{}", file.name);
    match rustix::fs::lstat(path.as_str()) {
        Ok(now) if now.st_ino == st.st_ino && now.st_dev == st.st_dev => {}
        _ => return Ok(false),
    }
    match std::fs::remove_file(&path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(OsError::io("unlink", path, e).into()),
    }
}

/// A liveness file is taken for stale only this long after it was made (`st_ctime`): between
/// creating the file and locking it (microseconds), a starting process's lock is free too
/// (docs/decisions.md). Younger ones with a free lock: [`young_free_liveness_files`].
pub const LIVENESS_FILE_GRACE: std::time::Duration =
    std::time::Duration::from_secs(STALE_AFTER_SECS as u64);

#[cfg(not(test))]
const STALE_AFTER_SECS: i64 = 5;
#[cfg(test)] // the unit tests wait for it
const STALE_AFTER_SECS: i64 = 1;

fn old_enough(st: &rustix::fs::Stat) -> bool {
    let now_ns = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as i128)
        .unwrap_or(i128::MAX);
    let ctime_ns = i128::from(st.st_ctime) * 1_000_000_000 + i128::from(st.st_ctime_nsec);
    now_ns - ctime_ns >= i128::from(STALE_AFTER_SECS) * 1_000_000_000
}

/// Parses `<prefix><ns>.<pid>.<start>` (the form of [`ProcessIdentity::file_name`]) into an
/// identity of boot `boot`; `None` for any other name.
pub(crate) fn parse_file_name(prefix: &str, name: &str, boot: [u8; 16]) -> Option<ProcessIdentity> {
    let rest = name.strip_prefix(prefix)?;
    let mut it = rest.split('.');
    let pid_ns = it.next()?.parse().ok()?;
    let pid = it.next()?.parse().ok()?;
    let start_time = it.next()?.parse().ok()?;
    if it.next().is_some() {
        return None;
    }
    Some(ProcessIdentity {
        pid,
        start_time,
        boot_id: boot,
        pid_ns,
    })
}

/// Removes the liveness file of `id` if its lock is free, whatever its age (for tests that kill
/// their own children: `cuda-ipc gc` leaves files younger than 5 s alone). `Ok(false)` when there
/// is no such file, it is not a regular file, or its lock is held.
///
/// # Errors
/// [`crate::Error::Os`] when `unlink` fails for a reason other than the file being gone.
pub fn remove_liveness_file_if_free(id: &ProcessIdentity) -> Result<bool> {
    let path = id.liveness_path();
    if probe_lock(id, None) != LockState::Free {
        return Ok(false);
    }
    match std::fs::remove_file(&path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(OsError::io("unlink", path, e).into()),
    }
}
