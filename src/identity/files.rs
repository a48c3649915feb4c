//! The liveness files of other processes in `/dev/shm`: which are stale (their process was
//! killed: the lock free, the file old enough), their removal after a second look, and the parse of
//! a per-process file name back into an identity.

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
/// removes the file). Files that are not regular files, whose lock cannot be tested, or that were
/// made less than 5 s ago (a process starting up locks its file right after making it) are left
/// out. For `cuda-ipc gc`; nothing is removed here.
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

/// The liveness files whose lock is free, `old` (at least [`LIVENESS_FILE_GRACE`] old) or young.
fn free_liveness_files(old: bool) -> Result<Vec<LivenessFile>> {
    let boot = boot_id()?;
    let dir = std::fs::read_dir(LIVE_DIR).map_err(|e| OsError::io("opendir", LIVE_DIR, e))?;
    let mut out = Vec::new();
    for ent in dir.flatten() {
        let Some(name) = ent.file_name().to_str().map(str::to_string) else {
            continue;
        };
        let Some(identity) = parse_file_name(LIVE_PREFIX, &name, boot) else {
            continue;
        };
        let path = format!("{LIVE_DIR}/{name}");
        let Ok(fd) = open_live_file(&path, false) else {
            continue;
        };
        let Ok(st) = rustix::fs::fstat(&fd) else {
            continue;
        };
        if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile
            || old_enough(&st) != old
        {
            continue;
        }
        if matches!(test_lock(&fd), Ok(false)) {
            out.push(LivenessFile {
                name,
                identity,
                uid: st.st_uid,
            });
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// Removes a stale liveness file (see [`stale_liveness_files`]) after testing its lock once more.
/// Returns `false` when it was not removed: it is gone already, its lock is held again (never, for
/// a dead process; a guard against a mistaken name) or it is no longer a regular file.
///
/// # Errors
/// [`crate::Error::Os`] when `unlink` fails for a reason other than the file being gone.
pub fn remove_stale_liveness_file(file: &LivenessFile) -> Result<bool> {
    let path = format!("{LIVE_DIR}/{}", file.name);
    let Ok(fd) = open_live_file(&path, false) else {
        return Ok(false);
    };
    match rustix::fs::fstat(&fd) {
        Ok(st)
            if rustix::fs::FileType::from_raw_mode(st.st_mode)
                == rustix::fs::FileType::RegularFile
                && old_enough(&st) => {}
        _ => return Ok(false),
    }
    if !matches!(test_lock(&fd), Ok(false)) {
        return Ok(false);
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
